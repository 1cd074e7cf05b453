#!/usr/bin/env python3
"""Train the default tiny DeepSeek-V3.2 model (MLA + DSA lightning indexer + MoE) on the text of
tools/train/prepare_data.sh, and write it in the published layout with MXFP4 routed experts.

    tools/train/prepare_data.sh DATADIR
    PYTHONUNBUFFERED=1 python3 tools/train/train_dsv32.py --data DATADIR --out OUTDIR

(models/dayzero-tiny and tests/data/dayzero_tiny came from exactly this on one H200: 1773 steps in 4 minutes,
then 2329 indexer-only steps in 2.5 minutes.) The indexer has DeepSeek-V3.2's size, 64 heads x 128 dims (the first
qk_rope_head_dim dims of each head rotary); --index-heads / --index-dim change it and --name the model folder, for
measuring other sizes; the defaults reproduce the shipped model.

Needs PyTorch, transformers (deepseek_v32), tokenizers and safetensors; one GPU. Writes:
  OUTDIR/NAME/           (--name, default dayzero-tiny) config.json, model.safetensors, tokenizer.json, tokenizer_config.json
  OUTDIR/reference.safetensors  prompt.i I64 [T], logits.i F32 [T, vocab], greedy.i I64 [12], margin.i F32 [12]
                                (transformers, float32 CPU, eager, the dequantised weights of the files)
  OUTDIR/metrics.json           held-out perplexity BF16 vs MXFP4 experts, next-token agreement, indexer recall
Training: byte-level BPE tokenizer; bf16 autocast, AdamW, cosine LR over a wall-clock budget; a dense
warm-up (index_topk >= context) then sparse attention (index_topk < context). transformers runs the indexer
under no_grad, so the indexer learns from its own loss: KL(p || softmax(indexer scores)) where p is the
head-summed attention distribution of the main model (detached), over the causal keys (dense phase) or the
selected keys (sparse phase); the indexer's inputs are detached so this loss never reaches the main model.
Router balance: DeepSeek-V3's bias update (e_score_correction_bias += u * sign(mean load - load)).
Then (--indexer-minutes) the indexer alone on the frozen language model, same KL, sparse phase: training both
longer over-fits the small language model (held-out perplexity 128 after 6.75 minutes, 66 after 4) while the
indexer's selections keep sharpening.
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "reference")]
from mxfp4 import dequant_mxfp4, quantize_mxfp4  # noqa: E402

T0 = time.time()
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|eos|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ASKS = ["Tell me something.", "Say something wise.", "Tell me a fortune.", "Tell me a joke.", "Hello",
        "What do you know?", "Define a word.", "Give me a quote.", "Hi!", "Surprise me."]
N_GREEDY = 12


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def render(messages, add_generation_prompt):
    s = "".join(f"<|{m['role']}|>\n{m['content']}<|eos|>\n" for m in messages)
    return s + ("<|assistant|>\n" if add_generation_prompt else "")


def read_docs(path):
    text = open(path, encoding="utf-8").read()
    return [d for d in text.split("\n\n") if d.strip()]


def train_tokenizer(docs, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=SPECIALS,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=tr)
    return tok


def make_config(V, ids, ctx, index_heads=4, index_dim=32):
    from transformers import AutoConfig
    c = dict(vocab_size=V, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
             n_routed_experts=16, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.0,
             norm_topk_prob=True, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=32,
             v_head_dim=32, index_n_heads=index_heads, index_head_dim=index_dim, index_topk=ctx, first_k_dense_replace=1,
             hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
             attention_bias=False, bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|eos|>"],
             pad_token_id=ids["<|pad|>"], initializer_range=0.02)
    return AutoConfig.for_model("deepseek_v32", rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **c)


def set_topk(model, k):
    model.config.index_topk = k
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = k


def indexer_scores(mod, hs, q_resid, cos, sin):
    """transformers' indexer scores [B, S, S] (before masking), with gradients to the indexer's weights."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
    B, S, _ = hs.shape
    r = mod.qk_rope_head_dim
    q = mod.wq_b(q_resid).view(B, S, mod.n_heads, mod.head_dim)
    q_rot, q_pass = torch.split(q, [r, mod.head_dim - r], dim=-1)
    k = mod.k_norm(mod.wk(hs)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [r, mod.head_dim - r], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    sc = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * mod.softmax_scale)
    w = mod.weights_proj(hs).float() * (mod.n_heads ** -0.5)
    return torch.matmul(w.unsqueeze(-2), sc).squeeze(-2)


class Taps:
    """Forward hooks: the indexer's inputs and selection, the attention probabilities, the router's choices."""

    def __init__(self, model):
        self.on = False
        self.idx, self.attn, self.loads = {}, {}, {}
        self.handles = []
        for li, layer in enumerate(model.model.layers):
            sa = layer.self_attn
            self.handles.append(sa.indexer.register_forward_hook(self._idx(li), with_kwargs=True))
            self.handles.append(sa.register_forward_hook(self._attn(li)))
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                self.handles.append(gate.register_forward_hook(self._gate(li)))

    def _idx(self, li):
        def h(mod, args, kwargs, out):
            if self.on:
                self.idx[li] = (args[0].detach(), args[1].detach(), args[2][0].detach(), args[2][1].detach(),
                                out.detach())
        return h

    def _attn(self, li):
        def h(mod, args, out):
            if self.on and isinstance(out, tuple) and len(out) > 1 and out[1] is not None:
                self.attn[li] = out[1].detach()
        return h

    def _gate(self, li):
        def h(mod, args, out):
            if self.on:
                ti = out[2].reshape(-1)
                self.loads[li] = (mod, torch.bincount(ti, minlength=mod.num_experts).float())
        return h


def kl_indexer_loss(model, taps, sparse):
    """Sum over layers of mean_rows KL(p || q): p = head-summed attention (normalised), q = softmax(scores)."""
    total, n = 0.0, 0
    for li, layer in enumerate(model.model.layers):
        if li not in taps.idx or li not in taps.attn:
            continue
        hs, qr, cos, sin, sel = taps.idx[li]
        att = taps.attn[li].float().sum(1)  # [B, S, S]
        B, S, _ = att.shape
        causal = torch.ones(S, S, dtype=torch.bool, device=att.device).tril()[None]
        mask = causal.expand(B, S, S)
        if sparse:
            chosen = torch.zeros(B, S, S, dtype=torch.bool, device=att.device).scatter(-1, sel.long(), True)
            mask = mask & chosen
        p = att.masked_fill(~mask, 0.0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
        sc = indexer_scores(layer.self_attn.indexer, hs, qr, cos, sin)
        logq = torch.log_softmax(sc.masked_fill(~mask, float("-inf")), dim=-1).masked_fill(~mask, 0.0)
        kl = (torch.xlogy(p, p) - p * logq).sum(-1).mean()
        total = total + kl
        n += 1
    return total, n


def random_windows(stream, batch, ctx):
    """batch windows of ctx + 1 consecutive tokens (inputs and next-token targets) at random starts."""
    starts = torch.randint(0, stream.numel() - ctx - 1, (batch,), device=stream.device)
    return stream[starts[:, None] + torch.arange(ctx + 1, device=stream.device)]


def train_indexer_only(model, taps, stream_d, args):
    """More indexer training on a frozen language model: the KL loss of the sparse phase, nothing else.
    The indexer's loss never reaches the main model anyway, so this sharpens only the selection."""
    params = [p for n, p in model.named_parameters() if ".indexer." in n]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    budget, t0, step = args.indexer_minutes * 60, time.time(), 0
    log(f"indexer-only phase: {sum(p.numel() for p in params) / 1e6:.2f}M parameters, {args.indexer_minutes} min")
    while (frac := (time.time() - t0) / budget) < 1:
        for g in opt.param_groups:
            g["lr"] = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        x = random_windows(stream_d, args.batch, args.ctx)[:, :-1]
        taps.on = True
        taps.idx.clear(), taps.attn.clear(), taps.loads.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.no_grad():
                model(input_ids=x, use_cache=False)
            kl, n_kl = kl_indexer_loss(model, taps, True)
        taps.on = False
        opt.zero_grad(set_to_none=True)
        kl.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 200 == 0:
            log(f"indexer-only step {step} frac {frac:.2f} kl {float(kl):.4f} (layers {n_kl})")
        step += 1
    for p in model.parameters():
        p.requires_grad_(True)
    log(f"indexer-only phase: {step} steps")
    return step


def published_state(model, cfg):
    """The model's tensors under the published names (routed experts per expert), float32 on the CPU."""
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    for li, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            sd[f"model.layers.{li}.mlp.gate.e_score_correction_bias"] = gate.e_score_correction_bias.detach().float().cpu()
    pub = {}
    for name, t in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len(".gate_up_proj")]
            assert tuple(t.shape[1:]) == (2 * I, H), (name, t.shape)
            for j in range(t.shape[0]):
                pub[f"{pre}.{j}.gate_proj.weight"] = t[j, :I].contiguous()
                pub[f"{pre}.{j}.up_proj.weight"] = t[j, I:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len(".down_proj")]
            assert tuple(t.shape[1:]) == (H, I), (name, t.shape)
            for j in range(t.shape[0]):
                pub[f"{pre}.{j}.down_proj.weight"] = t[j].contiguous()
        else:
            pub[name] = t
    return pub


def model_state(pub, model):
    """Published tensors (float) -> the model's state dict (fused experts, gate then up)."""
    out = {}
    for name, ref in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len(".gate_up_proj")]
            out[name] = torch.stack([torch.cat([pub[f"{pre}.{j}.gate_proj.weight"], pub[f"{pre}.{j}.up_proj.weight"]])
                                     for j in range(ref.shape[0])])
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len(".down_proj")]
            out[name] = torch.stack([pub[f"{pre}.{j}.down_proj.weight"] for j in range(ref.shape[0])])
        else:
            out[name] = pub[name]
        assert tuple(out[name].shape) == tuple(ref.shape), (name, out[name].shape, ref.shape)
    return out


def load_values(model, pub):
    model.load_state_dict(model_state(pub, model), strict=True)
    for li, layer in enumerate(model.model.layers):
        n = f"model.layers.{li}.mlp.gate.e_score_correction_bias"
        if n in pub:
            layer.mlp.gate.e_score_correction_bias.data.copy_(pub[n])


def is_expert(name):
    import re
    return re.match(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", name) is not None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder with train.txt and heldout.txt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=4.0, help="wall-clock training budget (language model + indexer)")
    ap.add_argument("--dense-frac", type=float, default=0.25, help="share of the budget trained dense")
    ap.add_argument("--indexer-minutes", type=float, default=2.5,
                    help="then train only the indexer (language model frozen, sparse attention) this long")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--index-heads", type=int, default=64, help="indexer heads (index_n_heads)")
    ap.add_argument("--index-dim", type=int, default=128,
                    help="indexer head dim (index_head_dim; >= qk_rope_head_dim 16; a power of two for the FP8 mode)")
    ap.add_argument("--name", default="dayzero-tiny", help="model folder under --out")
    args = ap.parse_args()
    if args.index_heads < 1 or args.index_dim < 16:
        sys.exit("error: --index-heads must be >= 1 and --index-dim >= qk_rope_head_dim (16)")
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    log("torch", torch.__version__, "transformers", transformers.__version__)
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device")
    dev = torch.device("cuda")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    for f in ("train.txt", "heldout.txt"):
        if not os.path.isfile(os.path.join(args.data, f)):
            sys.exit(f"error: {args.data}/{f} missing (run tools/train/prepare_data.sh)")
    train_docs = read_docs(os.path.join(args.data, "train.txt"))
    held_docs = read_docs(os.path.join(args.data, "heldout.txt"))
    log(f"docs: train {len(train_docs)}, held-out {len(held_docs)}")

    # --- tokenizer
    tok = train_tokenizer(train_docs, args.vocab)
    V = tok.get_vocab_size()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert all(v is not None for v in ids.values()), ids
    mdir = os.path.join(args.out, args.name)
    os.makedirs(mdir, exist_ok=True)
    tok.save(os.path.join(mdir, "tokenizer.json"))
    with open(os.path.join(mdir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
                   "pad_token": "<|pad|>", "add_bos_token": False, "add_eos_token": False,
                   "model_max_length": 4096, "clean_up_tokenization_spaces": False,
                   "chat_template": CHAT_TEMPLATE}, f, indent=2)
    log(f"tokenizer: vocab {V}, specials {ids}")

    # --- token streams: plain documents and chat turns (the reply is a document)
    samples = []
    for d in train_docs:
        if random.random() < 0.4:
            words = d.split()
            ask = random.choice(ASKS) if random.random() < 0.5 or len(words) < 3 else " ".join(words[: random.randint(1, 4)])
            samples.append(render([{"role": "user", "content": ask}, {"role": "assistant", "content": d}], False))
        else:
            samples.append(d + "<|eos|>\n")
    random.shuffle(samples)
    stream = torch.tensor([t for e in tok.encode_batch(samples) for t in e.ids], dtype=torch.long)
    held = torch.tensor([t for e in tok.encode_batch([d + "<|eos|>\n" for d in held_docs]) for t in e.ids],
                        dtype=torch.long)
    log(f"tokens: train {stream.numel()}, held-out {held.numel()} ({held.numel() / sum(map(len, held_docs)):.3f}/char)")

    # --- model
    cfg = make_config(V, ids, args.ctx, args.index_heads, args.index_dim)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).to(dev)
    n_par = sum(p.numel() for p in model.parameters())
    n_exp = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    log(f"params {n_par / 1e6:.2f}M (routed experts {n_exp / 1e6:.2f}M)")
    if hasattr(model, "set_experts_implementation"):
        try:  # the reference loop: no dependence on a grouped-GEMM kernel's autograd support
            model.set_experts_implementation("eager")
        except Exception as e:  # noqa: BLE001
            log(f"set_experts_implementation('eager') failed: {e}")
    log("experts implementation:", getattr(model.config, "_experts_implementation", "<unset>"))
    taps = Taps(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    stream_d = stream.to(dev)
    budget = args.minutes * 60
    t_start = time.time()
    step, warm, sparse, kl_ok = 0, 100, False, True
    hist = []
    model.train()
    while True:
        frac = (time.time() - t_start) / budget
        if frac >= 1:
            break
        if not sparse and frac >= args.dense_frac:
            sparse = True
            set_topk(model, args.topk)
            log(f"step {step}: sparse phase, index_topk {args.topk} of context {args.ctx}")
        lr = args.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        win = random_windows(stream_d, args.batch, args.ctx)
        x, y = win[:, :-1], win[:, 1:]
        taps.on = True
        taps.idx.clear(), taps.attn.clear(), taps.loads.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x, use_cache=False).logits
            lm = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
            kl, n_kl = torch.zeros((), device=dev), 0
            if kl_ok:
                try:
                    kl, n_kl = kl_indexer_loss(model, taps, sparse)
                except Exception as e:  # noqa: BLE001 - keep training the language model, say so
                    kl_ok = False
                    log(f"INDEXER KL DISABLED: {type(e).__name__}: {e}")
        taps.on = False
        loss = lm + (kl if n_kl else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing
            for mod, load in taps.loads.values():
                mod.e_score_correction_bias.add_(1e-3 * torch.sign(load.mean() - load))
        if step == 0 and n_kl == 0:
            log(f"WARNING: no indexer KL this step (captured idx {list(taps.idx)}, attn {list(taps.attn)})")
        if step % 100 == 0:
            loads = [f"{float(l.max() / l.mean()):.2f}" for _, l in taps.loads.values()]
            log(f"step {step} frac {frac:.2f} lr {lr:.2e} lm {float(lm):.3f} kl {float(kl):.3f} (layers {n_kl}) "
                f"max/mean expert load {loads}")
        hist.append((step, float(lm), float(kl)))
        step += 1
    log(f"trained {step} steps, {step * args.batch * args.ctx / 1e6:.1f}M tokens")
    set_topk(model, args.topk)
    idx_steps = train_indexer_only(model, taps, stream_d, args) if args.indexer_minutes > 0 else 0
    model.eval()

    # --- save: routed experts MXFP4, the rest BF16 (router bias F32)
    pub = published_state(model, cfg)
    files, v_bf16, v_mx = {}, {}, {}
    for n, t in pub.items():
        b = t.float() if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
        v_bf16[n] = b.float()
        if is_expert(n):
            blocks, scales = quantize_mxfp4(b.float())
            stem = n[: -len(".weight")]
            files[stem + ".weight_blocks"], files[stem + ".weight_scales"] = blocks, scales
            v_mx[n] = dequant_mxfp4(blocks, scales)
        else:
            files[n] = b.contiguous()
            v_mx[n] = b.float()
    save_file(files, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    cdict = json.loads(cfg.to_json_string(use_diff=False))
    for k in ("_attn_implementation", "_name_or_path"):
        cdict.pop(k, None)
    cdict.update(dtype="bfloat16", torch_dtype="bfloat16", index_topk=args.topk, architectures=["DeepseekV32ForCausalLM"])
    cdict["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_experts",
        "model.layers.0.mlp", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(cdict, f, indent=2)
    size = sum(os.path.getsize(os.path.join(mdir, f)) for f in os.listdir(mdir))
    log(f"saved {mdir}: {sorted(os.listdir(mdir))}, {size / 1e6:.2f} MB")

    metrics = {"transformers": transformers.__version__, "torch": torch.__version__, "steps": step,
               "train_tokens_seen": step * args.batch * args.ctx, "train_stream_tokens": stream.numel(),
               "heldout_tokens": held.numel(), "params": n_par, "routed_expert_params": n_exp,
               "context": args.ctx, "index_topk": args.topk, "dense_fraction": args.dense_frac,
               "minutes": args.minutes, "indexer_kl_trained": kl_ok,
               "indexer_only_minutes": args.indexer_minutes, "indexer_only_steps": idx_steps, "vocab": V,
               "index_n_heads": args.index_heads, "index_head_dim": args.index_dim,
               "final_train_lm_loss": sum(h[1] for h in hist[-50:]) / max(1, len(hist[-50:])),
               "final_indexer_kl": sum(h[2] for h in hist[-50:]) / max(1, len(hist[-50:]))}

    # --- held-out perplexity, BF16 experts vs MXFP4 experts (float32, GPU, sparse attention as saved)
    def heldout_eval(values):
        load_values(model, values)
        nll, cnt, preds = 0.0, 0, []
        with torch.no_grad():
            for s in range(0, held.numel() - args.ctx - 1, args.ctx):
                w = held[s: s + args.ctx + 1].to(dev)
                lg = model(input_ids=w[None, :-1], use_cache=False).logits[0].float()
                nll += float(F.cross_entropy(lg, w[1:], reduction="sum"))
                cnt += args.ctx
                preds.append(lg.argmax(-1).cpu())
        return math.exp(nll / cnt), torch.cat(preds), cnt

    try:
        ppl_b, pred_b, cnt = heldout_eval(v_bf16)
        ppl_m, pred_m, _ = heldout_eval(v_mx)
        metrics.update(heldout_ppl_bf16_experts=ppl_b, heldout_ppl_mxfp4_experts=ppl_m, heldout_eval_tokens=cnt,
                       next_token_agreement_bf16_vs_mxfp4=float((pred_b == pred_m).float().mean()))
        log(f"held-out ppl: BF16 experts {ppl_b:.3f}, MXFP4 experts {ppl_m:.3f}; agreement "
            f"{metrics['next_token_agreement_bf16_vs_mxfp4']:.4f} over {cnt} tokens")
    except Exception as e:  # noqa: BLE001
        log(f"held-out eval failed: {type(e).__name__}: {e}")
        load_values(model, v_mx)

    # --- indexer recall: its top-k against the top-k of the dense attention (head-summed), rows t >= k
    try:
        set_topk(model, args.ctx)
        hits, tot, per_layer = 0, 0, {}
        with torch.no_grad():
            for s in range(0, min(held.numel() - args.ctx, 64 * args.ctx), args.ctx):
                w = held[s: s + args.ctx].to(dev)
                taps.on = True
                taps.idx.clear(), taps.attn.clear()
                model(input_ids=w[None], use_cache=False)
                taps.on = False
                for li, layer in enumerate(model.model.layers):
                    hs, qr, cos, sin, _ = taps.idx[li]
                    sc = indexer_scores(layer.self_attn.indexer, hs, qr, cos, sin)[0]
                    att = taps.attn[li][0].float().sum(0)
                    S, k = sc.shape[0], args.topk
                    causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
                    sc = sc.masked_fill(~causal, float("-inf"))[k:]
                    att = att.masked_fill(~causal, float("-inf"))[k:]
                    a = torch.zeros_like(sc, dtype=torch.bool).scatter(-1, sc.topk(k, -1).indices, True)
                    b = torch.zeros_like(att, dtype=torch.bool).scatter(-1, att.topk(k, -1).indices, True)
                    h = int((a & b).sum())
                    hits += h
                    tot += int(b.sum())
                    ph = per_layer.setdefault(li, [0, 0])
                    ph[0] += h
                    ph[1] += int(b.sum())
        metrics["indexer_recall_vs_dense_topk"] = hits / max(1, tot)
        metrics["indexer_recall_per_layer"] = {str(li): v[0] / max(1, v[1]) for li, v in per_layer.items()}
        metrics["random_selection_recall"] = "k/(t+1) averaged over rows t >= k: " + str(
            sum(args.topk / (t + 1) for t in range(args.topk, args.ctx)) / (args.ctx - args.topk))
        log(f"indexer recall {metrics['indexer_recall_vs_dense_topk']:.4f} per layer {metrics['indexer_recall_per_layer']}")
    except Exception as e:  # noqa: BLE001
        log(f"indexer recall failed: {type(e).__name__}: {e}")
    set_topk(model, args.topk)

    # --- samples (GPU, MXFP4 values, sparse, no cache)
    def generate(m, ids_, n, temp, device):
        seq = torch.tensor(ids_, dtype=torch.long, device=device)
        with torch.no_grad():
            for _ in range(n):
                lg = m(input_ids=seq[None], use_cache=False).logits[0, -1].float()
                if temp <= 0:
                    nxt = lg.argmax()
                else:
                    v, i = (lg / temp).topk(40)
                    nxt = i[torch.multinomial(torch.softmax(v, -1), 1)[0]]
                seq = torch.cat([seq, nxt[None]])
                if int(nxt) == ids["<|eos|>"]:
                    break
        return tok.decode(seq[len(ids_):].tolist(), skip_special_tokens=False)

    try:
        load_values(model, v_mx)
        samples_out = []
        for p in ["Hello", "Tell me a fortune.", "What is a hacker?", "Say something wise."]:
            pr = tok.encode(render([{"role": "user", "content": p}], True)).ids
            for temp in (0.0, 0.8):
                g = generate(model, pr, 80, temp, dev)
                samples_out.append({"prompt": p, "temperature": temp, "text": g})
                log(f"SAMPLE [{p!r} T={temp}] {g!r}")
        metrics["samples"] = samples_out
    except Exception as e:  # noqa: BLE001
        log(f"sampling failed: {type(e).__name__}: {e}")

    # --- reference: transformers, float32 CPU, eager, the dequantised values of the saved files
    try:
        cpu = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
        set_topk(cpu, args.topk)
        load_values(cpu, v_mx)
        ctaps = Taps(cpu)

        def near_ties(seq):
            """Rows whose indexer top-k boundary (k-th vs (k+1)-th score) is within 1e-6 relative: there the
            selection is not well defined for an independent implementation."""
            ctaps.on = True
            ctaps.idx.clear(), ctaps.attn.clear()
            cpu(input_ids=seq[None], use_cache=False)
            ctaps.on = False
            n = 0
            k = args.topk
            for li, layer in enumerate(cpu.model.layers):
                hs, qr, cos, sin, _ = ctaps.idx[li]
                sc = indexer_scores(layer.self_attn.indexer, hs, qr, cos, sin)[0].double()
                for t in range(k, sc.shape[0]):
                    v = torch.sort(sc[t, : t + 1], descending=True).values
                    if float(v[k - 1] - v[k]) <= 1e-6 * max(float(v.abs().max()), 1e-30):
                        n += 1
            return n

        def reference(p):
            pt = torch.tensor(p, dtype=torch.long)
            logits = cpu(input_ids=pt[None], use_cache=False).logits[0].float().contiguous()
            seq, greedy, margins = pt.clone(), [], []
            for _ in range(N_GREEDY):
                last = cpu(input_ids=seq[None], use_cache=False).logits[0, -1].float()
                top = last.topk(2)
                greedy.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                seq = torch.cat([seq, top.indices[:1]])
            return pt, logits, greedy, margins, near_ties(seq[:-1])

        ref, chosen = {}, []
        # Prompt 0: a chat turn (shorter than index_topk); prompt 1: 100 held-out tokens (sparse), the first
        # candidate window without near-tied top-k boundaries and with greedy margins above 1e-3.
        cands = [[tok.encode(render([{"role": "user", "content": "Tell me a fortune."}], True)).ids],
                 [held[s: s + 100].tolist() for s in range(0, min(held.numel() - 100, 8 * 997), 997)]]
        with torch.no_grad():
            for i, group in enumerate(cands):
                best = None
                for p in group:
                    r = reference(p)
                    score = (r[4], -min(r[3]))
                    if best is None or score < best[0]:
                        best = (score, r)
                    if r[4] == 0 and min(r[3]) > 1e-3:
                        break
                pt, logits, greedy, margins, ties = best[1]
                ref[f"prompt.{i}"], ref[f"logits.{i}"] = pt, logits
                ref[f"greedy.{i}"] = torch.tensor(greedy, dtype=torch.int64)
                ref[f"margin.{i}"] = torch.tensor(margins, dtype=torch.float32)
                chosen.append({"length": pt.numel(), "near_ties": ties, "min_margin": min(margins)})
                log(f"reference {i}: T={pt.numel()} greedy {greedy} min margin {min(margins):.4f} near ties {ties} "
                    f"text {tok.decode(greedy, skip_special_tokens=False)!r}")
        prompts = [ref[f"prompt.{i}"] for i in range(len(cands))]
        save_file(ref, os.path.join(args.out, "reference.safetensors"))
        metrics["reference"] = {"prompts": chosen, "greedy_tokens": N_GREEDY,
                                "dtype": "float32, CPU, eager attention, use_cache=False, index_topk "
                                         f"{args.topk}, dequantised MXFP4 experts"}
    except Exception as e:  # noqa: BLE001
        log(f"reference failed: {type(e).__name__}: {e}")
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    log("done", json.dumps({k: v for k, v in metrics.items() if k != "samples"}))


if __name__ == "__main__":
    main()
