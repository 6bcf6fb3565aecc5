#!/usr/bin/env python3
"""HF Transformers peer of `odmoe-bench engine`: the same config with random weights, batch 1.

bf16 weights, attn_implementation="sdpa", greedy, EOS ignored (min_new_tokens = max_new_tokens), one warm-up
request per (prompt, output) pair, then --repeat timed requests (the median is reported). Times come from
time.perf_counter() after torch.cuda.synchronize(): TTFT = request start to the first generated token, decode
tokens/s = (output - 1) / (time of the last token - time of the first), the definitions odmoe uses.
The weights are Transformers' own random init (normal, initializer_range), built directly on the GPU in bf16:
not odmoe's synthetic values, but the same shapes, dtype and top-k, hence the same bytes per token.

Prints one JSON line per pair (plus one `setup` line with the versions) and then a table:
  python3 bench/peers/hf_transformers.py --config configs/models/mixtral-8x7b/config.json --layers 16
"""
import argparse
import json
import statistics
import sys
import time


def parse_pairs(text):
    pairs = []
    for item in text.split(","):
        p, n = item.lower().split("x")
        pairs.append((int(p), int(n)))
    return pairs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/models/mixtral-8x7b/config.json",
                    help="a config.json (or a folder holding one)")
    ap.add_argument("--layers", type=int, default=16, help="replaces num_hidden_layers (0: keep the config's)")
    ap.add_argument("--seed", type=int, default=1, help="torch seed of the random init")
    ap.add_argument("--pairs", default="16x64,16x256,128x64,128x256", help="PROMPTxOUTPUT,...")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    import os
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    path = args.config
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    if args.layers > 0:
        cfg["num_hidden_layers"] = args.layers
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    load_start = time.perf_counter()
    # Built in bf16 directly on the device (a 16-layer Mixtral is ~47 GB in bf16; fp32 on the host would not fit).
    with device:
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - load_start
    n_params = sum(p.numel() for p in model.parameters())
    assert next(model.parameters()).dtype == torch.bfloat16

    setup = {
        "bench": "engine", "kind": "setup", "peer": "hf_transformers", "config": path,
        "layers": config.num_hidden_layers, "params": n_params, "load_s": load_s, "dtype": "bfloat16",
        "attn_implementation": getattr(model.config, "_attn_implementation", "sdpa"),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
        "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
    }
    print(json.dumps(setup), flush=True)

    class TokenTimes(BaseStreamer):
        """Records when each generated token reaches the host (the first put() is the prompt)."""

        def __init__(self):
            self.times = []
            self.seen_prompt = False

        def put(self, value):
            if not self.seen_prompt:
                self.seen_prompt = True
                return
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

        def end(self):
            pass

    bos = config.bos_token_id
    vocab = config.vocab_size

    def request(prompt_len, new_tokens):
        ids = [bos if (i == 0 and bos is not None) else 3 + (i * 37) % (vocab - 3) for i in range(prompt_len)]
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        mask = torch.ones_like(input_ids)
        streamer = TokenTimes()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, use_cache=True, streamer=streamer,
                                 pad_token_id=config.eos_token_id if config.eos_token_id is not None else 0)
        if cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        generated = out.shape[1] - prompt_len
        assert generated == new_tokens, (generated, new_tokens)
        t = streamer.times
        ttft_ms = (t[0] - start) * 1e3
        tps = (len(t) - 1) / (t[-1] - t[0]) if len(t) >= 2 and t[-1] > t[0] else 0.0
        return ttft_ms, tps, (end - start) * 1e3

    rows = []
    for p, n in parse_pairs(args.pairs):
        request(p, n)  # warm-up
        ttft, tps = [], []
        for _ in range(args.repeat):
            a, b, _ = request(p, n)
            ttft.append(a)
            tps.append(b)
        row = {"bench": "engine", "kind": "pair", "peer": "hf_transformers", "prompt_tokens": p,
               "output_tokens": n, "repeat": args.repeat, "ttft_ms": statistics.median(ttft),
               "decode_tokens_per_s": statistics.median(tps), "gpu": setup["gpu"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    print(json.dumps({"bench": "engine", "kind": "memory", "peer": "hf_transformers", "peak_device_bytes": peak}),
          flush=True)

    print(f"\nHF Transformers {transformers.__version__} / torch {torch.__version__} on {setup['gpu']}: "
          f"{config.num_hidden_layers} layers, {n_params / 1e9:.2f} B params, peak {peak / 1e9:.2f} GB")
    print(f"{'prompt':<8} {'output':<8} {'ttft_ms':>12} {'decode_tok/s':>14}")
    for r in rows:
        print(f"{r['prompt_tokens']:<8} {r['output_tokens']:<8} {r['ttft_ms']:>12.2f} {r['decode_tokens_per_s']:>14.2f}")


if __name__ == "__main__":
    main()
