"""Hugging Face twins of GGUF files, for the equivalence tests: every tensor as gguf-py
dequantizes it, and transformers' GptOssForCausalLM over a gpt-oss file's tensors (transformers'
own GGUF reader does not take gpt-oss: `gpt_oss_twin`), its MixtralForCausalLM over a Mixtral
file's (`mixtral_state`, `mixtral_twin`: a `llama` file with experts, which it does not take
either); and HF's greedy ids with each step's top-2 gap (`hf_greedy`), compared up to the
first near-tie (`compared_prefix`)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def gguf_py_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `file` under its GGUF name, as gguf-py dequantizes it (float32)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    return {
        t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        for t in GGUFReader(file).tensors
    }


NEAR_TIE = 1e-3  # a top-2 gap below this: float32 summation order may pick either id


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy ids over raw logits (no logits processors) and each step's top-2 gap."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        ids, gaps = [], []
        for _ in range(n):
            top = out.logits[0, -1].topk(2)
            ids.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            out = hf(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, gaps


def compared_prefix(gaps: list[float]) -> int:
    """Steps whose ids must agree: up to and including the first near-tie."""
    return next((i + 1 for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))


def mixtral_state(file: Path, config) -> dict[str, torch.Tensor]:
    """A Mixtral file's tensors as gguf-py dequantizes them, under transformers' names: q/k
    rows un-permuted (llama.cpp's rotary order), each layer's experts' gate and up fused
    (E, 2I, D) and down (E, D, I) as transformers holds them."""
    from tandem.loaders.gguf.names import hf_name, unpermute_rows

    state = {}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for gguf, x in gguf_py_tensors(file).items():
        name = hf_name(gguf)
        for proj, n in heads.items():
            if f"self_attn.{proj}." in name:
                x = unpermute_rows(x, n)
        state[name] = x
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate, up = state.pop(p + "gate_proj.weight"), state.pop(p + "up_proj.weight")
        state[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        state[p + "down_proj"] = state.pop(p + "down_proj.weight")
    return state


def mixtral_twin(file: Path):
    """transformers' MixtralForCausalLM (the file's config) over `mixtral_state`, strictly."""
    from tandem.loaders.gguf.model_file import GGUFModel

    config = GGUFModel(file).config
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**config.to_hf_dict()))
    hf.load_state_dict(mixtral_state(file, config), strict=True)
    return hf.eval()


def gpt_oss_hf_config(reader) -> transformers.GptOssConfig:
    """transformers' GptOssConfig from a gpt-oss file's metadata, read here with gguf-py: its
    own GGUF reader (5.24) fails on the file's `rope.scaling.*` values."""

    def get(key, default=None):
        f = reader.fields.get("gpt-oss." + key)
        return default if f is None else f.contents()

    return transformers.GptOssConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=get("embedding_length"),
        intermediate_size=get("expert_feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=get("attention.head_count"),
        num_key_value_heads=get("attention.head_count_kv"),
        # a writer states key_length only where it is not width / heads (tandem's writer)
        head_dim=get("attention.key_length")
        or get("embedding_length") // get("attention.head_count"),
        num_local_experts=get("expert_count"),
        num_experts_per_tok=get("expert_used_count"),
        sliding_window=get("attention.sliding_window"),
        max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_parameters=dict(
            rope_type="yarn", rope_theta=get("rope.freq_base"), factor=get("rope.scaling.factor"),
            original_max_position_embeddings=get("rope.scaling.original_context_length"),
            beta_fast=get("rope.scaling.yarn_beta_fast"), beta_slow=get("rope.scaling.yarn_beta_slow"),
            truncate=True,
        ),  # fmt: skip
        tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip


def gpt_oss_twin(file: Path):
    """transformers' GptOssForCausalLM over the tensors gguf-py dequantizes from a gpt-oss file
    (gate/up re-interleaved as transformers holds them), every tensor loaded strictly."""
    from gguf import GGUFReader

    reader = GGUFReader(file)
    hf = transformers.GptOssForCausalLM(gpt_oss_hf_config(reader)).eval()
    state = gguf_py_tensors(file)
    hf_state = {"model.embed_tokens.weight": state.pop("token_embd.weight"),
                "model.norm.weight": state.pop("output_norm.weight"),
                "lm_head.weight": state.pop("output.weight")}  # fmt: skip
    names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate_inp": "mlp.router"}  # fmt: skip
    for i in range(hf.config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for g, h in names.items():
            for leaf in ("weight", "bias"):
                if f"{b}{g}.{leaf}" in state:
                    hf_state[f"{p}{h}.{leaf}"] = state.pop(f"{b}{g}.{leaf}")
        hf_state[p + "self_attn.sinks"] = state.pop(b + "attn_sinks.weight")
        gate, up = state.pop(b + "ffn_gate_exps.weight"), state.pop(b + "ffn_up_exps.weight")
        E, W, D = gate.shape
        fused = torch.stack((gate, up), dim=2).reshape(E, 2 * W, D)  # gate/up rows interleaved
        hf_state[p + "mlp.experts.gate_up_proj"] = fused.transpose(1, 2)  # (E, D, 2W)
        gb, ub = state.pop(b + "ffn_gate_exps.bias"), state.pop(b + "ffn_up_exps.bias")
        hf_state[p + "mlp.experts.gate_up_proj_bias"] = torch.stack((gb, ub), dim=2).reshape(
            E, 2 * W
        )
        hf_state[p + "mlp.experts.down_proj"] = state.pop(b + "ffn_down_exps.weight").transpose(
            1, 2
        )
        hf_state[p + "mlp.experts.down_proj_bias"] = state.pop(b + "ffn_down_exps.bias")
    assert not state, sorted(state)
    hf.load_state_dict(hf_state, strict=True)
    return hf


def assert_logits_follow(ex, hf, atol: float, steps=(7, 300, 42, 1, 99), seed: int = 5) -> None:
    """A 20-token prefill of random ids below 512 on executor `ex` (sequence 0), then `steps`
    decoded one at a time: each step's last logits within `atol` of transformers' `hf` over the
    same prefix."""
    import numpy as np

    from tandem.engine.executor import Step, StepSequence

    ids = [int(t) for t in np.random.default_rng(seed).integers(0, 512, 20)]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1].numpy()
    got = ex.run(Step((StepSequence(0, tuple(ids), 0),))).logits[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    for t in steps:
        ids.append(t)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -1].numpy()
        got = ex.run(Step((StepSequence(0, (t,), len(ids) - 1),))).logits[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def phi3_twin(file: Path):
    """transformers' Phi3ForCausalLM configured as a phi3 file states itself (tandem's reading
    of it: partial rotary, longrope's factor tensors and attention factor, the window, which
    transformers' own GGUF reader ignores) over the tensors gguf-py dequantizes, the fused
    attn_qkv / ffn_up under HF's fused names; the head tied to the embedding where the file has
    no output.weight."""
    from tandem.loaders.gguf.model_file import GGUFModel
    from tandem.loaders.gguf.names import hf_name

    config = GGUFModel(file).config
    fused = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
    state = {}
    for g, x in gguf_py_tensors(file).items():
        if g.startswith("rope_factors"):  # in the config
            continue
        parts = g.split(".")
        if g.startswith("blk.") and parts[2] in fused:
            state[f"model.layers.{parts[1]}.{fused[parts[2]]}.weight"] = x
        else:
            state[hf_name(g)] = x
    hf_cfg = transformers.Phi3Config(**config.to_hf_dict(), pad_token_id=0)
    hf = transformers.Phi3ForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf
