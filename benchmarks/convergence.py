r"""Convergence on real text: megatrain_ray (bf16 and fp32 gradients) against a GPU-resident PyTorch run.

The corpus is text that ships with the installed Python packages (licences, READMEs, docs, then
source files up to ``--corpus-mb``), so it exists offline on any machine; a byte-level BPE is
trained on it with the ``tokenizers`` library. A Qwen2.5-0.5B-shaped model (hidden 896, 24 layers,
14 query / 2 KV heads, MLP 4864, tied embeddings; the vocabulary is the BPE's) is initialised once
by transformers and saved as an HF checkpoint; every variant starts from it and sees the same
batches in the same order:

- ``megatrain_ray``: the pipeline with its defaults (bf16 compute, gradients to the host in bf16);
- ``megatrain_ray_fp32_grads``: the same with ``precision.grad_dtype=float32``;
- ``gpu_resident``: :class:`benchmarks.reference.ResidentTrainer` (fp32 weights on the GPU,
  bf16 autocast, fp32 gradients, torch AdamW);
- ``megatrain_ray_8bit``: the compact optimizer state (``optim.state=8bit``: 8-bit moments, bf16 master,
  stochastic rounding); ``megatrain_ray_bf16_master``: ``precision.master_dtype=bfloat16`` (fp32 moments).

``--ref`` names the variant the others' final losses are compared with (default gpu_resident). On a
machine without a GPU, ``--device cpu`` with a small shape (``--hidden``, ``--layers``) runs the same
comparison in fp32 compute::

    python benchmarks/convergence.py --device cpu --hidden 128 --layers 4 --seq-len 128 --vocab 2048 \
        --micro-batch-size 4 --micro-batches 2 --corpus-mb 4 --local \
        --variants megatrain_ray,megatrain_ray_8bit,megatrain_ray_bf16_master --ref megatrain_ray --out OUT

Writes convergence.json (per-step losses, grad norms, s/step, final and validation losses) and
convergence.png (the curves) into ``--out``; prints a table last. Run on a GPU machine::

    python benchmarks/convergence.py --steps 300 --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.data.loader import source_from_config  # noqa: E402
from benchmarks.reference import ResidentModel, ResidentTrainer  # noqa: E402
from megatrain_ray.io.evaluate import checkpoint_reader  # noqa: E402
from megatrain_ray.io.hf_io import load_train_config  # noqa: E402
from megatrain_ray.orchestration.cluster import connect_ray  # noqa: E402
from megatrain_ray.orchestration.pipeline import train  # noqa: E402

DOC_SUFFIXES = (".md", ".rst", ".txt")
DOC_PREFIXES = ("LICENSE", "LICENCE", "COPYING", "README", "NOTICE", "AUTHORS")


def package_roots() -> list[str]:
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], "/usr/share/doc",
             *[p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]}
    return sorted(r for r in roots if os.path.isdir(r))


def build_corpus(path: str, limit_bytes: int) -> dict:
    """Documents (one per file) as JSON lines: docs and licences first, then Python sources."""
    docs, code = [], []
    for root in package_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                if name.endswith(DOC_SUFFIXES) or name.upper().startswith(DOC_PREFIXES):
                    docs.append(full)
                elif name.endswith(".py"):
                    code.append(full)
    total, files = 0, 0
    with open(path, "w") as f:
        for full in docs + code:
            try:
                with open(full, encoding="utf-8") as src:
                    text = src.read()
            except (UnicodeDecodeError, OSError):
                continue
            if len(text) < 200:
                continue
            f.write(json.dumps({"text": text}) + "\n")
            total, files = total + len(text), files + 1
            if total >= limit_bytes:
                break
    return {"bytes": total, "documents": files, "doc_files": len(docs), "roots": package_roots()}


def train_tokenizer(corpus: str, out: str, vocab: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        with open(corpus) as f:
            for line in f:
                yield json.loads(line)["text"]

    tok.train_from_iterator(texts(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    return tok.get_vocab_size()


def init_checkpoint(out: str, vocab: int, seq_len: int, hidden: int = 896, layers: int = 24) -> None:
    """The Qwen2.5-0.5B shape (hidden 896, 24 layers), or a narrower one with the same head size and MLP ratio."""
    import transformers

    torch.manual_seed(0)
    heads, inter = max(2, hidden // 64), hidden * 4864 // 896 // 8 * 8
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=seq_len,
                                   tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
    transformers.Qwen2ForCausalLM(cfg).float().save_pretrained(out, safe_serialization=True)


def tokenize_corpus(corpus: str, tokenizer_dir: str, out: str) -> str:
    """The corpus as one EOS-separated token stream (.npy), for --local runs (no Ray Data)."""
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    eos, ids = tok.token_to_id("<|endoftext|>"), []
    with open(corpus) as f:
        for line in f:
            ids += tok.encode(json.loads(line)["text"]).ids + [eos]
    np.save(out, np.array(ids, dtype=np.int64))
    return out


def run_local(cfg) -> dict:
    """Our engine's roles in one process (megatrain_ray.orchestration.local): the same math, no Ray."""
    from megatrain_ray.orchestration.local import train_local

    t0 = time.perf_counter()
    rows = train_local(cfg, 0)
    return {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows], "val_losses": {},
            "step_s": statistics.median(r["step_s"] for r in rows[3:]), "wall_s": time.perf_counter() - t0}


def run_ours(cfg) -> dict:
    t0 = time.perf_counter()
    result = train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    return {"losses": result.losses, "grad_norms": result.grad_norms, "val_losses": result.val_losses,
            "step_s": statistics.median(r["step_s"] for r in rows[3:]), "wall_s": time.perf_counter() - t0,
            "final_dir": result.final_dir}


def run_resident(cfg) -> dict:
    t0 = time.perf_counter()
    model = ResidentModel.from_reader(cfg.model, checkpoint_reader(cfg.train.init_from)[1], "cuda",
                                      autocast=torch.bfloat16)
    trainer = ResidentTrainer(model, cfg.optim, cfg.train.steps)
    source = source_from_config(cfg, connect=connect_ray)
    val = source_from_config(cfg, "val", connect=connect_ray).batch(0)
    losses, norms, times, val_losses = [], [], [], {}
    for step in range(cfg.train.steps):
        if cfg.train.eval_due(step):
            ids = torch.as_tensor(val["input_ids"], device="cuda").flatten(0, 1)
            labels = torch.as_tensor(val["labels"], device="cuda").flatten(0, 1)
            val_losses[step] = model.mean_loss(ids, labels)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss, norm = trainer.step(step, source.batch(step))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss)
        norms.append(norm)
    return {"losses": losses, "grad_norms": norms, "val_losses": val_losses, "step_s": statistics.median(times[3:]),
            "wall_s": time.perf_counter() - t0}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        smooth = [statistics.mean(r["losses"][max(0, i - 9):i + 1]) for i in range(len(r["losses"]))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=f"{name} (final {r['final_loss']:.3f})", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean of the last 10 steps)")
    ax.set_title("Qwen2.5-0.5B shape on package text: megatrain_ray vs GPU-resident PyTorch")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--corpus-mb", type=float, default=40)
    ap.add_argument("--variants", default="gpu_resident,megatrain_ray,megatrain_ray_fp32_grads")
    ap.add_argument("--ref", default="gpu_resident", help="the variant the others are compared with")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--device", default="auto", help="compute.device of our runs (auto, cuda, cpu)")
    ap.add_argument("--data-workers", type=int, default=8, help="data.num_workers (at most the CPUs Ray has)")
    ap.add_argument("--local", action="store_true",
                    help="run our variants in one process without Ray, on the corpus tokenized into one .npy stream "
                         "(random windows; no validation loss): for a small CPU machine")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    work = os.path.join(args.out, "work") if not os.environ.get("CONVERGENCE_WORK") else os.environ["CONVERGENCE_WORK"]
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, "corpus.jsonl")
    report = {"corpus": build_corpus(corpus, int(args.corpus_mb * 2**20))}
    report["vocab"] = train_tokenizer(corpus, os.path.join(work, "tokenizer"), args.vocab)
    init_checkpoint(os.path.join(work, "init"), report["vocab"], args.seq_len, args.hidden, args.layers)
    print("corpus:", report["corpus"]["bytes"] / 2**20, "MiB,", report["corpus"]["documents"], "documents; vocab",
          report["vocab"], flush=True)
    base = [f"train.init_from={work}/init", f"data.path={corpus}", "data.format=text",
            f"data.tokenizer={work}/tokenizer", "data.val_fraction=0.01", f"data.cache_dir={work}/cache",
            f"data.num_workers={args.data_workers}", f"train.run_dir={work}/runs", "cluster.ray_address=local", f"train.steps={args.steps}",
            f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch_size}",
            f"train.num_micro_batches={args.micro_batches}", f"train.eval_every={max(1, args.steps // 10)}",
            "train.log_every=25", "train.checkpoint_every=0", "optim.lr=1e-3", "optim.min_lr=1e-4",
            f"optim.warmup_steps={max(1, args.steps // 10)}", "optim.weight_decay=0.1", "optim.max_grad_norm=1.0",
            f"compute.device={args.device}"]
    if args.local:
        tokens = tokenize_corpus(corpus, os.path.join(work, "tokenizer"), os.path.join(work, "tokens.npy"))
        base = [o for o in base if not o.startswith(("data.", "train.eval_every"))] + [
            f"data.path={tokens}", "data.format=windows", "train.eval_every=0"]
    variants = {"megatrain_ray": ("ours", []), "megatrain_ray_fp32_grads": ("ours", ["precision.grad_dtype=float32"]),
                "gpu_resident": ("resident", []), "megatrain_ray_8bit": ("ours", ["optim.state=8bit"]),
                "megatrain_ray_bf16_master": ("ours", ["precision.master_dtype=bfloat16"])}
    results = {}
    for name in args.variants.split(","):
        kind, extra = variants[name]
        cfg = load_train_config(None, base + extra)
        print(f"== {name}", flush=True)
        results[name] = (run_local if args.local else run_ours)(cfg) if kind == "ours" else run_resident(cfg)
        r = results[name]
        r["final_loss"] = statistics.mean(r["losses"][-20:])
        print(f"{name}: final loss (mean of the last 20 steps) {r['final_loss']:.4f}, {r['step_s']:.3f} s/step",
              flush=True)
    report["tokens_per_step"] = args.seq_len * args.micro_batch_size * args.micro_batches
    report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    ref = results.get(args.ref)
    for r in results.values():
        if ref is not None:
            r["final_vs_resident"] = r["final_loss"] / ref["final_loss"] - 1
    report["results"] = results
    with open(os.path.join(args.out, "convergence.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    plot(results, os.path.join(args.out, "convergence.png"))
    print(f"\n{report['gpu']}, {args.steps} steps x {report['tokens_per_step']} tokens, vocab {report['vocab']}")
    vs = "vs " + args.ref
    print(f"{'variant':<26}{'first':>8}{'final':>8}{vs:>{len(vs) + 2}}{'last val':>10}{'s/step':>8}")
    for name, r in results.items():
        last_val = r["val_losses"][max(r["val_losses"])] if r["val_losses"] else float("nan")
        print(f"{name:<26}{r['losses'][0]:>8.3f}{r['final_loss']:>8.3f}{r.get('final_vs_resident', 0):>+{len(vs) + 1}.2%} "
              f"{last_val:>9.3f}{r['step_s']:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
