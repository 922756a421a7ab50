"""The decode-kernel choice for linear layers (`tandem.kernels.linear`, through `tandem.kernels.prepare`): same results as F.linear,
fused groups equal their parts, tied weights stay shared, packed weights replace (not duplicate)
the dense ones, and a lazily mapped checkpoint's pages are released after packing."""

import copy

import pytest
import torch
from kernel_variants import each_variant
from tp_support import greedy_steps, random_reference, tiny_config, write_random_model

from tandem.engine.local import LocalExecutor
from tandem.kernels import native
from tandem.kernels.linear import (
    NATIVE,
    ONEDNN,
    PACKED,
    TORCH,
    KernelError,
    KernelLinear,
    _native_bf16_cpu,
    _onednn_cpu,
    choose_kernel,
    linear,
    release_file_pages,
)
from tandem.kernels.prepare import prepare
from tandem.loaders.load import load_model
from tandem.loaders.safetensors_dir import ModelDir
from tandem.models.layers import MLP

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
HAS_ONEDNN = _onednn_cpu()
HAS_PACKED = HAS_ONEDNN and _native_bf16_cpu()
HAS_NATIVE = native.available()
needs_onednn = pytest.mark.skipif(not HAS_ONEDNN, reason="no oneDNN x86 CPU path here")
needs_packed = pytest.mark.skipif(not HAS_PACKED, reason="CPU without native bf16")


def _tokens(config, seed=1):
    return torch.randint(
        0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(seed)
    )


def test_kernel_table_keeps_non_cpu_devices_on_torch_and_prefers_the_native_gemv():
    assert choose_kernel("meta", torch.float32) == TORCH
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert (choose_kernel("cpu", dtype) == NATIVE) == HAS_NATIVE
    if not HAS_NATIVE:
        assert choose_kernel("cpu", torch.float16) == TORCH
        assert choose_kernel("cpu", torch.float32) in (ONEDNN, TORCH)


def test_unknown_kernel_or_tied_head_mode_is_a_typed_error():
    model = random_reference(tiny_config())
    with pytest.raises(KernelError, match="unknown kernel"):
        prepare(model, kernel="fast")
    with pytest.raises(KernelError, match="tied_head"):
        prepare(model, tied_head="maybe")


@needs_onednn
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_prepared_float32_model_matches_f_linear_within_1e_5(arch, fuse):
    config = tiny_config(arch, mlp_bias=arch == "LlamaForCausalLM")
    ref = random_reference(config)
    ours = copy.deepcopy(ref)
    report = prepare(ours, kernel=ONEDNN, fuse=fuse)
    assert report.layers == ({ONEDNN: 9} if fuse else {ONEDNN: 15})
    assert report.fused == (4 if fuse else 0) and report.packed_bytes == 0
    tokens = _tokens(config)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), ref(tokens), atol=1e-5, rtol=0)


@needs_onednn
def test_linear_helper_dispatches_dense_and_packed_weights_alike():
    x, w, b = torch.randn(2, 5, 64), torch.randn(48, 64), torch.randn(48)
    ref = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(linear(x, w, b), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(linear(x[:, -1:], w, b), ref[:, -1:], atol=1e-5, rtol=0)
    if HAS_PACKED:
        wb, xb = w.bfloat16(), x.bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(wb, 1)
        torch.testing.assert_close(linear(xb, packed), linear(xb, wb), atol=0.05, rtol=0.02)


def test_tied_head_keeps_sharing_the_embedding_and_state_dict_names_the_fused_weights():
    config = tiny_config("Qwen3ForCausalLM")
    assert config.tie_word_embeddings
    model = random_reference(config).to(torch.bfloat16)
    prepare(model)
    assert isinstance(model.lm_head, KernelLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    keys = model.state_dict().keys()
    assert "model.layers.0.self_attn.qkv_proj.weight" in keys
    assert "model.layers.0.mlp.gate_up_proj.weight" in keys
    assert "model.layers.0.self_attn.q_proj.weight" not in keys
    assert prepare(model).layers == {}  # a second call finds nothing to do


@needs_packed
@pytest.mark.parametrize("tied_head", ["share", "copy"])
def test_packed_bf16_replaces_dense_weights_and_follows_the_torch_kernel(tied_head):
    config = tiny_config("Qwen3ForCausalLM")
    ref = random_reference(config).to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    report = prepare(ours, kernel=PACKED, tied_head=tied_head)
    layer_bytes = sum(p.numel() * 2 for n, p in ref.named_parameters() if n.endswith("proj.weight"))
    assert report.packed_bytes == layer_bytes
    head = ours.lm_head.weight
    assert head.is_mkldnn == (tied_head == "copy")
    assert report.copied_bytes == (head.numel() * 2 if tied_head == "copy" else 0)
    assert not ours.model.embed_tokens.weight.is_mkldnn
    tokens = _tokens(config)
    with torch.no_grad():
        a, b = ours(tokens).float(), ref(tokens).float()
    assert (a - b).abs().max().item() < 0.1  # bf16 rounding of a different summation order
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.skipif(not (HAS_ONEDNN or HAS_NATIVE), reason="no CPU decode kernel here")
def test_local_executor_greedy_ids_equal_on_either_kernel(tmp_path):
    config = tiny_config("Qwen2ForCausalLM")
    d = write_random_model(tmp_path / "m", config)
    fast = LocalExecutor(load_model(ModelDir(d)), max_batch=1, max_seq_len=32)
    slow = LocalExecutor(load_model(ModelDir(d)), max_batch=1, max_seq_len=32, kernels=TORCH)
    assert isinstance(fast.model.model.layers["0"].mlp.gate_up_proj, KernelLinear)
    assert fast.model.model.layers["0"].mlp.gate_up_proj.kernel == choose_kernel(
        "cpu", torch.float32
    )
    slow_mlp = slow.model.model.layers["0"].mlp  # "torch": the reference modules, unfused
    assert type(slow_mlp) is MLP and slow_mlp.gate_proj.kernel == TORCH
    ids = {
        name: [i for i, _ in greedy_steps(ex, [5, 6, 7], 8)]
        for name, ex in (("fast", fast), ("slow", slow))
    }
    assert ids["fast"] == ids["slow"]


def _resident_bytes(t: torch.Tensor) -> int:
    """Resident bytes of the pages under `t` (mincore-free: /proc/self/smaps of its mapping)."""
    lo = t.data_ptr()
    cur = None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            a, b = (int(x, 16) for x in head[0].split("-"))
            cur = (a, b) if a <= lo < b else None
        elif cur and head[0] == "Rss:":
            return int(head[1]) * 1024
    return -1


@pytest.mark.skipif(not HAS_PACKED, reason="packing is what releases pages")
def test_packing_releases_the_mapped_checkpoint_pages_but_never_anonymous_memory(tmp_path):
    config = tiny_config("LlamaForCausalLM", hidden_size=256, intermediate_size=1024)
    ref = random_reference(config).to(torch.bfloat16)
    from tandem.loaders.writer import write_model_dir

    write_model_dir(
        tmp_path / "m", config, {k: v.contiguous() for k, v in ref.state_dict().items()}
    )
    md = ModelDir(tmp_path / "m")
    mapped = md.read("model.layers.0.mlp.down_proj.weight")  # 512 KiB, lazily mapped
    mapped.sum()  # fault every page in
    before = _resident_bytes(mapped)
    assert release_file_pages(mapped) > 0
    assert _resident_bytes(mapped) < before
    assert torch.equal(mapped, ref.model.layers["0"].mlp.down_proj.weight)  # re-read from file
    anon = torch.ones(1 << 20)
    assert release_file_pages(anon) == 0 and anon.sum().item() == 1 << 20


@needs_packed
def test_auto_tied_head_packs_a_copy_only_over_a_mapped_checkpoint_and_rows_still_read_right(
    tmp_path,
):
    config = tiny_config("Qwen3ForCausalLM", vocab_size=4096, hidden_size=256)
    ref = random_reference(config).to(torch.bfloat16)
    from tandem.loaders.writer import write_model_dir

    state = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    write_model_dir(tmp_path / "m", config, state)
    model = load_model(ModelDir(tmp_path / "m"), dtype=torch.bfloat16)  # mapped, not copied
    report = prepare(model, kernel=PACKED)
    assert model.lm_head.weight.is_mkldnn and report.copied_bytes == 4096 * 256 * 2
    table = model.model.embed_tokens.weight
    assert not table.is_mkldnn and torch.equal(table, ref.model.embed_tokens.weight)
    tokens = _tokens(config)
    with torch.no_grad():
        a, b = model(tokens).float(), ref(tokens).float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9


needs_native = pytest.mark.skipif(not HAS_NATIVE, reason=f"no native GEMV: {native.why()}")


@needs_native
@pytest.mark.usefixtures(each_variant.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_native_gemv_equals_a_float64_product_rounded_once(dtype, rows):
    """Odd sizes on purpose: a K tail shorter than the vector loop, N not a multiple of anything,
    one row per thread and many; float32 sums, one rounding to the weight's dtype."""
    g = torch.Generator().manual_seed(rows)
    for n, k in ((1, 16), (7, 64), (33, 1030), (4096, 1024), (300, 3000)):
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(rows, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g)
        exact = x.double() @ w.double().T + b.double()  # (rows, n)
        y = native.gemv(x, w, b)
        assert y.dtype == dtype and y.shape == (rows, n)
        tol = 2e-6 * k**0.5 if dtype == torch.float32 else 0.0
        ulp = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
        err = (y.double() - exact).abs() / exact.abs().clamp_min(1.0)
        assert err.max().item() <= tol + ulp, (n, k, err.max().item())


@needs_native
@pytest.mark.usefixtures(each_variant.__name__)
def test_native_gemv_result_does_not_depend_on_the_thread_count():
    w, x = torch.randn(5000, 512), torch.randn(2, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.gemv(x, w)
        torch.set_num_threads(2)
        two = native.gemv(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_native
def test_native_gemv_refuses_what_it_cannot_run_with_a_typed_error():
    w = torch.randn(8, 16)
    with pytest.raises(native.NativeError, match="features"):
        native.gemv(torch.randn(1, 15), w)
    with pytest.raises(native.NativeError, match="rows"):
        native.gemv(torch.randn(native.MAX_ROWS + 1, 16), w)
    with pytest.raises(native.NativeError, match="contiguous"):
        native.gemv(torch.randn(1, 8), w.T)
    with pytest.raises(native.NativeError, match="contiguous"):
        native.gemv(torch.randn(1, 16, dtype=torch.float64), w.double())
    with pytest.raises(KernelError, match="native"):
        prepare(random_reference(tiny_config()).double(), kernel=NATIVE)


@needs_native
@pytest.mark.parametrize("arch", ARCHS)
def test_native_kernel_model_matches_f_linear_at_decode_and_prefill(arch):
    """Decode-sized inputs (<= MAX_ROWS rows) and wider ones take the native row kernel (the
    library GEMM only with TANDEM_LIBRARY_PREFILL); the logits are F.linear's within float32
    rounding, biases included."""
    config = tiny_config(arch, mlp_bias=arch == "LlamaForCausalLM")
    ref = random_reference(config)
    ours = copy.deepcopy(ref)
    report = prepare(ours)
    assert report.layers == {NATIVE: 9}
    with torch.no_grad():
        for shape in ((1, 1), (4, 1), (3, 9)):
            tokens = torch.randint(0, config.vocab_size, shape, generator=torch.Generator())
            torch.testing.assert_close(ours(tokens), ref(tokens), atol=1e-5, rtol=0)


@needs_native
def test_native_bf16_head_shares_the_embedding_without_a_copy_and_follows_the_torch_kernel():
    config = tiny_config("Qwen3ForCausalLM")
    ref = random_reference(config).to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    report = prepare(ours)
    assert ours.lm_head.kernel == NATIVE and ours.lm_head.weight is ours.model.embed_tokens.weight
    assert report.packed_bytes == 0 and report.copied_bytes == 0
    tokens = torch.randint(0, config.vocab_size, (1, 1), generator=torch.Generator())
    with torch.no_grad():
        a, b = ours(tokens).float(), ref(tokens).float()
    assert (a - b).abs().max().item() < 0.1  # bf16 rounding of a different summation order
    assert torch.equal(a.argmax(-1), b.argmax(-1))


PORTABLE_CHECK = """
import torch
from tandem.kernels import native
assert native.available(), native.why()
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for rows in (1, 3):
        for n, k in ((33, 1030), (512, 1024)):
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(rows, k, generator=g).to(dtype)
            exact = x.double() @ w.double().T
            err = (native.gemv(x, w).double() - exact).abs() / exact.abs().clamp_min(1.0)
            limit = 2e-6 * k**0.5 if dtype == torch.float32 else 2**-7
            assert err.max().item() <= limit, (dtype, rows, n, k, err.max().item())
    # batch invariance: a row's product is the same bits alone, in a decode group or a prefill
    # (tiles of 2 rows of W by 6 of X in blocks of 256 columns: an odd row count of W, a K % 32
    # tail, partial tiles of X, a bias)
    w = torch.randn(71, 1030, generator=g).to(dtype)
    x = torch.randn(37, 1030, generator=g).to(dtype)
    b32 = torch.randn(71, generator=g)
    for bias in (None, b32):
        whole = native.gemv_unchecked(x, w, bias)
        for a, b in ((0, 1), (3, 7), (5, 37), (1, 6), (0, 4)):
            part = native.gemv_unchecked(x[a:b], w, bias)
            assert torch.equal(part, whole[a:b]), (dtype, a, b)
"""


@needs_native
@pytest.mark.usefixtures(each_variant.__name__)
def test_the_native_kernel_is_batch_invariant_in_this_build():
    """PORTABLE_CHECK's checks (products within rounding, each row the same bits at any row
    count: the decode row kernel at 1-4 rows, the prefill tiles past 4) in every ISA variant's
    build (AVX-512 BF16's bf16 dot; AVX2's in-lane unpack with X permuted to match)."""
    exec(PORTABLE_CHECK, {})


@needs_native
def test_a_native_layer_refuses_an_input_of_the_wrong_width_instead_of_reading_past_it():
    """1 row of 2*in elements fits the decode bound (<= 4*in elements): it must not be taken as
    2 rows (the output holds 1)."""
    layer = torch.nn.Sequential(torch.nn.Linear(64, 32))
    prepare(layer)
    assert layer[0].kernel == NATIVE
    with pytest.raises(native.NativeError, match="features"):
        layer(torch.randn(1, 128))
    with pytest.raises(native.NativeError, match="features"):
        linear(torch.randn(1, 128), torch.randn(32, 64))


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_f32_tiles_linear_is_a_float32_product_rounded_once(wdtype, xdtype, monkeypatch):
    """The prefill kernel for 16-bit weights on a CPU without native bf16: tiles of the weight
    widened to float32 (small tiles here, so a ragged last tile too), the result rounded once to
    x's dtype, row-major, with the bias; the weight is not widened whole."""
    from tandem.kernels import wide as lin

    monkeypatch.setattr(lin, "TILE_BYTES", 16 * 4 * 72)  # 16 rows of K=72 per tile
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 72, generator=g).to(wdtype)
    x = torch.randn(2, 37, 72, generator=g).to(xdtype)
    b = torch.randn(300, generator=g).to(wdtype)
    exact = x.double() @ w.double().T + b.double()  # (2, 37, 300)
    y = lin.f32_tiles_linear(x, w, b)
    assert y.dtype == xdtype and y.shape == (2, 37, 300) and y.is_contiguous()
    ulp = {torch.float32: 0.0, torch.bfloat16: 2**-8}[xdtype]
    err = (y.double() - exact).abs() / exact.abs().clamp_min(1.0)
    assert err.max().item() <= 2e-6 * 72**0.5 + ulp
    if not _native_bf16_cpu():
        assert lin._wide_kernel(w) is lin.f32_tiles_linear


@pytest.mark.skipif(not HAS_NATIVE, reason="no native build here")
@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["full-rotary", "partial-rotary"])
def test_prepared_phi3_decodes_as_the_reference_across_the_longrope_switch(tmp_path, partial):
    """Phi-3 (fused checkpoint, longrope switching past 32 tokens): the native modules (full
    rotary: norm+RoPE in C and the one-call decode; partial rotary: the reference's RoPE, the
    rest native) give the reference modules' logits within float32 rounding at every step of
    a 40-token generation that crosses the switch."""
    from dataclasses import replace

    from tandem.config import RopeScaling
    from tandem.models.presets import get_preset

    base = get_preset("tiny-phi3").config
    n = int(base.head_dim * partial) // 2
    scaling = replace(base.rope_scaling, short_factor=(1.2,) * n, long_factor=(3.0,) * n)
    config = replace(base, partial_rotary_factor=partial, rope_scaling=scaling)
    assert isinstance(config.rope_scaling, RopeScaling)
    d = write_random_model(tmp_path / "m", config)
    fast = LocalExecutor(load_model(ModelDir(d)), max_batch=1, max_seq_len=64)
    slow = LocalExecutor(load_model(ModelDir(d)), max_batch=1, max_seq_len=64, kernels=TORCH)
    got, want = greedy_steps(fast, [5, 6, 7, 8], 40), greedy_steps(slow, [5, 6, 7, 8], 40)
    assert [i for i, _ in got] == [i for i, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
