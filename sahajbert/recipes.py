"""How the reference runs trained and evaluated: `--recipe` for pretraining, `--protocol` for fine-tuning.

A recipe or protocol is a set of flag values, applied under the flags given explicitly (those win) and under a
settings file. Each value names where the reference sets it. Both references were read at these commits:
- DeDLOC's sahajBERT (2021): yandex-research/DeDLOC at 10a9df8, folder `sahajbert/` (D below).
- sahajBERT-XL (2021): tanmoyio/sahajBERT at 0462fe4 (X below).
The recipe and protocol tables of docs/models-and-evaluation.md list these values; `tests/test_recipes.py` checks
that they agree.
"""

RECIPES: dict[str, dict[str, object]] = {
    "sahajbert": {
        "model": "sahajbert",  # D arguments.py:95: albert-large-v2's config
        "learning_rate": 0.00176,  # D arguments.py:110
        "warmup_steps": 5000,  # D arguments.py:111
        # D arguments.py:109 max_steps = 1,000,000 ("Albert is actually ready after 125000 steps"), which
        # run_trainer.py:99 passes as the schedule's length: the learning rate barely decays in a run
        "total_steps": 1_000_000,
        "adam_epsilon": 1e-6,  # D arguments.py:112
        "weight_decay": 0.01,  # D arguments.py:113
        "clamp_value": 10_000.0,  # D arguments.py:115
        "max_grad_norm": 1.0,  # D arguments.py:114
        "clip_gradients": "local",  # the HF Trainer clips each peer's gradients before its optimizer step
        "per_device_train_batch_size": 4,  # D arguments.py:104
        "gradient_accumulation_steps": 2,  # D arguments.py:106
        "max_seq_length": 512,  # D arguments.py:107
        "precision": "auto",  # D arguments.py:117 fp16 = True: fp16 compute on GPUs (auto: fp16 on CUDA >= 7.0)
        "target_batch_size": 4096,  # D arguments.py:60
        "compression": "fp16",  # D arguments.py:76 FLOAT16
        "matchmaking_time": 5.0,  # D arguments.py:24 averaging_expiration
        "averaging_timeout": 30.0,  # D arguments.py:27
        "target_group_size": 256,  # D arguments.py:51
        "metadata_expiration": 30.0,  # D arguments.py:53
        "max_refresh_period": 30.0,  # D arguments.py:37
        "bandwidth": 100.0,  # D arguments.py:72
        "masking": "token",  # D run_trainer.py:272 DataCollatorForLanguageModeling
        "sentence_boundaries": "punctuation",  # D dataset_streaming.py:33 danda rewrite, then NLTK punkt
        "chunking": "references",  # D dataset_streaming.py:38 sentences until max_seq_length, then truncated
    },
    "sahajbert-xl": {
        "model": "sahajbert-xl",  # X model.json: LeanALBERT
        "learning_rate": 0.005,  # X arguments.py:118
        "warmup_steps": 3125,  # X arguments.py:120
        "total_steps": 15_625,  # X arguments.py:119
        "adam_epsilon": 1e-6,  # X arguments.py:121
        "weight_decay": 0.01,  # X arguments.py:122
        "clamp_value": 10_000.0,  # X arguments.py:124
        "max_grad_norm": 1.0,  # X arguments.py:123
        "clip_gradients": "averaged",  # X run_trainer.py:89 LambWithGradientClipping: inside the optimizer step
        "per_device_train_batch_size": 4,  # X arguments.py:112
        "gradient_accumulation_steps": 1,  # X arguments.py:114
        "max_seq_length": 512,  # X arguments.py:115
        "precision": "fp32",  # X arguments.py:126 fp16 = False
        "target_batch_size": 16_384,  # X arguments.py:74
        "compression": "adaptive",  # X run_trainer.py:168-169: fp16 below 2^16 + 1 elements, 8-bit from there
        "matchmaking_time": 30.0,  # X arguments.py:42 averaging_expiration
        "averaging_timeout": 120.0,  # X arguments.py:45
        "target_group_size": 256,  # X arguments.py:65
        "metadata_expiration": 120.0,  # X arguments.py:67
        "max_refresh_period": 30.0,  # X arguments.py:51
        "bandwidth": 100.0,  # X arguments.py:86
        "masking": "token",  # X run_trainer.py:187 DataCollatorForLanguageModeling
        "sentence_boundaries": "punctuation",  # X data.py:33 danda rewrite, then NLTK punkt
        "chunking": "references",  # X data.py:38 sentences until max_seq_length, then truncated
    },
}

# the fine-tuning protocols, per task: both keep the epoch with the best validation loss
_DEDLOC_PROTOCOL = {
    "learning_rate": 1e-5,  # D README.md:82 (NER), :97 (news)
    "max_seq_length": 128,  # D README.md:83, :98
    "num_train_epochs": 20.0,  # D README.md:84, :99
    "per_device_train_batch_size": 128,  # D README.md:85, :100
    "per_device_eval_batch_size": 128,  # D README.md:86, :101
    "gradient_accumulation_steps": 1,
    "early_stopping_patience": 3,  # D README.md:87, :102
    "early_stopping_threshold": 0.01,  # D README.md:88, :103
    "best_model_metric": "loss",  # D train_ner.py:112-113 metric_for_best_model = "loss"
    "hidden_dropout_prob": None,  # the checkpoint's own (0 in sahajBERT's config)
}
_XL_PROTOCOL = {
    "num_train_epochs": 20.0,  # X README.md:31, :46
    "per_device_train_batch_size": 8,  # X README.md:32, :47
    "per_device_eval_batch_size": 8,  # X README.md:32, :47
    "gradient_accumulation_steps": 8,  # X README.md:32, :47
    "early_stopping_patience": 3,  # X README.md:33, :48
    "early_stopping_threshold": 0.01,  # X README.md:33, :48
    "best_model_metric": "loss",  # X train_ner.py:143-144, train_ncc.py:130-131
    "hidden_dropout_prob": 0.1,  # X train_ner.py:63, :194; train_ncc.py:59, :180 (dropout_prob)
}
PROTOCOLS: dict[str, dict[str, dict[str, object]]] = {
    "ner": {
        "sahajbert": _DEDLOC_PROTOCOL,
        "sahajbert-xl": {**_XL_PROTOCOL, "learning_rate": 3e-5, "max_seq_length": 256},  # X README.md:31
    },
    "ncc": {
        "sahajbert": _DEDLOC_PROTOCOL,
        "sahajbert-xl": {**_XL_PROTOCOL, "learning_rate": 1e-5, "max_seq_length": 128},  # X README.md:46
    },
}
