"""One real vLLM engine (``vllm.LLM``) in its own process, for the real-engine tests.

    python _engine_proc.py '{"model": DIR, "ec": {...} | null, "llm": {...}}'

``ec`` is the ``ec_transfer_config`` (None: no EC connector). Prints ``@@{"ready": ...}`` once the
engine is up, then reads one JSON command per line on stdin and answers one ``@@<json>`` line on
stdout (vLLM logs to stdout/stderr too, so replies are marked):

    {"cmd": "generate", "requests": [{"image": i, "side": 224, "text": "...",
                                      "params": {...} | null, "max_tokens": 8}]}
        -> {"outputs": [{"tokens": [...], "params": ec_transfer_params | null, "s": seconds,
                         "stages": {"waiting_s", "running_s"} | null}]}
           (requests are sent together; "s" is the whole batch's wall time)
    {"cmd": "reset_encoder_cache"} -> {}   (vLLM's own encoder cache: as if evicted)
    {"cmd": "shutdown"} -> {}              (the engine is shut down, then the process exits)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def reply(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _stages(o) -> dict | None:
    """Engine-core timestamps of a request (vLLM's ``RequestStateStats``, present when the engine
    logs stats): seconds from queued to scheduled (waiting, e.g. for a fetch) and from scheduled
    to the first token (loads, encoder, prefill)."""
    m = getattr(o, "metrics", None)
    if m is None or not getattr(m, "first_token_ts", 0.0):
        return None
    return {"waiting_s": m.scheduled_ts - m.queued_ts,
            "running_s": m.first_token_ts - m.scheduled_ts}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from tiny_vlm import make_image, prompt
    from vllm import LLM, SamplingParams

    kw = dict(model=cfg["model"], dtype="bfloat16", enforce_eager=True, max_model_len=512,
              limit_mm_per_prompt={"image": 1, "video": 0}, enable_prefix_caching=False, seed=0)
    kw.update(cfg.get("llm", {}))  # the caller's settings win (e.g. a longer max_model_len)
    if cfg.get("ec") is not None:
        kw["ec_transfer_config"] = cfg["ec"]
    t0 = time.monotonic()
    llm = LLM(**kw)
    reply({"ready": time.monotonic() - t0, "pid": os.getpid()})
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        try:
            out: dict = {}
            if cmd == "generate":
                prompts, params = [], []
                for r in msg["requests"]:
                    prompts.append({"prompt": prompt(r.get("text", "Describe the image.")),
                                    "multi_modal_data": {"image": make_image(
                                        r["image"], r.get("side", 224))}})
                    extra = {"ec_transfer_params": r["params"]} if r.get("params") else None
                    params.append(SamplingParams(temperature=0.0, max_tokens=r.get("max_tokens", 8),
                                                 extra_args=extra))
                t = time.monotonic()
                res = llm.generate(prompts, params, use_tqdm=False)
                s = time.monotonic() - t
                out = {"outputs": [{"tokens": list(o.outputs[0].token_ids) if o.outputs else [],
                                    "params": o.ec_transfer_params, "s": s,
                                    "stages": _stages(o)} for o in res]}
            elif cmd == "reset_encoder_cache":
                llm.llm_engine.engine_core.reset_encoder_cache()
            elif cmd == "shutdown":
                llm.llm_engine.engine_core.shutdown()
                reply({})
                return
            else:
                out = {"error": f"unknown command {cmd!r}"}
        except Exception:  # noqa: BLE001 - reported to the test, the process keeps serving
            out = {"error": traceback.format_exc()}
        reply(out)


if __name__ == "__main__":
    main()
