"""benchmarks/gpu_check.py, the prepared run for a CUDA machine, run on the CPU (`--device cpu`): every check but
CUDA's own kernels, so that the script works the day a GPU is at hand (`make test-scale`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.scale
@pytest.mark.timeout(900)
def test_the_gpu_check_runs_its_checks_on_the_cpu_and_prints_one_table(tmp_path):
    output = tmp_path / "gpu_check.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick"]
    done = subprocess.run([*command, "--output_json", str(output)], capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(output.read_text())
    assert [row["check"] for row in rows] == [
        "device",
        "two trainers, fp32, local clipping",
        "two DiLoCo trainers, bf16",
        "trainer alone vs plain loop",
    ]
    assert all(row["passed"] for row in rows), rows
    for row in rows[1:3]:
        assert "steps [3, 3]" in row["result"] and "parameters agree" in row["result"], row
    overhead = rows[3]["rows"]
    assert [(r["model"], r["mode"]) for r in overhead] == [("tiny", "dp"), ("tiny", "diloco")]
    for r in overhead:
        assert r["trainer_samples_per_s"] > 0 and r["plain_samples_per_s"] > 0 and r["trainer_peak_pss_mib"] > 0
        assert r["throughput_ratio"] == pytest.approx(r["trainer_samples_per_s"] / r["plain_samples_per_s"])
    assert "| check | result | passed | seconds |" in done.stdout and "4/4 checks passed" in done.stdout
