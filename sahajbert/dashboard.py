"""The aux peer's live dashboard: one self-contained page (no CDN, works offline) and /api/state as JSON."""

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger(__name__)

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>sahajBERT swarm</title>
<style>
body{font-family:system-ui,sans-serif;margin:2rem;color:#222}
.cards{display:flex;gap:1rem;flex-wrap:wrap}
.card{border:1px solid #ccc;border-radius:8px;padding:.8rem 1.2rem;min-width:9rem}
.card b{display:block;font-size:1.8rem}
.charts{display:flex;gap:1rem;flex-wrap:wrap;margin:1rem 0}
svg{border:1px solid #ddd;background:#fafafa}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3rem .7rem;text-align:right}
</style></head><body>
<h1>Run <span id="run_id">?</span></h1>
<p id="run_status"></p>
<div class="cards">
 <div class="card">global step<b id="global_step">-</b></div>
 <div class="card">peers training<b id="alive_peers">-</b></div>
 <div class="card">loss<b id="loss">-</b></div>
 <div class="card">samples/s<b id="samples_per_second">-</b></div>
</div>
<div class="charts">
 <div>loss per global step<br><svg id="chart_loss" width="420" height="180"></svg></div>
 <div>swarm samples/s<br><svg id="chart_throughput" width="420" height="180"></svg></div>
 <div>peers per global step<br><svg id="chart_peers" width="420" height="180"></svg></div>
</div>
<table><thead><tr><th>peer</th><th>status</th><th>step</th><th>samples contributed</th><th>samples/s</th>
<th>last seen</th></tr></thead>
<tbody id="peers"></tbody></table>
<p id="updated"></p>
<script>
function chart(id, points, key) {
  const svg = document.getElementById(id), w = svg.width.baseVal.value, h = svg.height.baseVal.value;
  const values = points.filter(p => p[key] !== null);
  if (values.length === 0) { svg.innerHTML = ""; return; }
  const xs = values.map(p => p.step), ys = values.map(p => p[key]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = x => 30 + (w - 40) * (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5);
  const sy = y => h - 20 - (h - 30) * (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5);
  const path = values.map((p, i) => (i ? "L" : "M") + sx(p.step).toFixed(1) + "," + sy(p[key]).toFixed(1)).join("");
  // one dot per global step (a single step still shows), joined by a line
  const dots = values.map(p => '<circle class="pt" cx="' + sx(p.step).toFixed(1) + '" cy="' +
    sy(p[key]).toFixed(1) + '" r="2.5" fill="#1f6feb"/>').join("");
  svg.innerHTML = '<path d="' + path + '" fill="none" stroke="#1f6feb" stroke-width="2"/>' + dots +
    '<text x="2" y="12" font-size="10">' + y1.toPrecision(4) + '</text>' +
    '<text x="2" y="' + (h - 22) + '" font-size="10">' + y0.toPrecision(4) + '</text>' +
    '<text x="30" y="' + (h - 5) + '" font-size="10">step ' + x0 + '</text>' +
    '<text x="' + (w - 60) + '" y="' + (h - 5) + '" font-size="10">step ' + x1 + '</text>';
}
async function refresh() {
  try {
    const s = await (await fetch("/api/state")).json();
    for (const k of ["run_id", "global_step", "alive_peers", "run_status"]) {
      document.getElementById(k).textContent = s[k];
    }
    document.getElementById("loss").textContent = s.loss === null ? "-" : s.loss.toFixed(4);
    document.getElementById("samples_per_second").textContent = s.samples_per_second.toFixed(1);
    chart("chart_loss", s.history, "loss");
    chart("chart_throughput", s.history, "samples_per_second");
    chart("chart_peers", s.history, "peers");
    document.getElementById("peers").innerHTML = s.peers.map(p =>
      "<tr><td>" + p.peer + "</td><td>" + p.status + "</td><td>" + p.step + "</td><td>" +
      p.samples_contributed + "</td><td>" + p.samples_per_second.toFixed(1) + "</td><td>" +
      p.last_seen_seconds_ago + " s ago</td></tr>").join("");
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) { document.getElementById("updated").textContent = "aux peer unreachable: " + e; }
}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""


class Dashboard:
    """Serves PAGE and the JSON of `state()` from a daemon thread."""

    def __init__(self, host: str, port: int, state: Callable[[], dict]):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] == "/api/state":
                    body, kind = json.dumps(state()).encode(), "application/json"
                elif self.path.split("?")[0] in ("/", "/index.html"):
                    body, kind = PAGE.encode(), "text/html; charset=utf-8"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # one access line per 2-second refresh would drown the monitor's log
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="dashboard")
        self.thread.start()
        logger.info(f"dashboard at {self.url} (JSON at {self.url}api/state)")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
