#!/usr/bin/env python3
"""Write docs/precision.md from the metrics of tools/train/train_dsv32.py and the FP8 indexer measurement of
`dz indexer-fp8` (tests/data/dayzero_tiny/indexer_fp8.json, when present) and at other indexer sizes
(tests/data/dayzero_tiny/indexer_fp8_sizes.json, when present).

    python3 tools/train/precision_report.py [--metrics tests/data/dayzero_tiny/metrics.json]
        [--indexer-fp8 tests/data/dayzero_tiny/indexer_fp8.json]
        [--indexer-sizes tests/data/dayzero_tiny/indexer_fp8_sizes.json] [--out docs/precision.md]
"""
import argparse
import json
import math
import os

# Acceptable bounds for the default model. The perplexity and recall bounds were fixed before the
# first training run; the agreement bound was chosen after seeing that run (0.8835), so it is a loose
# regression check, not an independent target (the report says so).
PPL_RATIO_MAX = 1.05        # held-out perplexity, MXFP4 experts / BF16 experts
AGREEMENT_MIN = 0.85        # next-token argmax agreement, MXFP4 vs BF16 experts
RECALL_MIN = 0.80           # indexer top-k recall against the dense attention's top-k
# Targets of the FP8 indexer mode against the exact indexer, fixed before measuring on this model.
FP8_RECALL_MIN = 0.99       # top-k recall, averaged over positions (rows with more than k visible tokens)
FP8_COSINE_MIN = 0.999      # per-position logits cosine


def fp8_indexer_section(j, heads, dim):
    """Markdown lines for the FP8 indexer measurement of `dz indexer-fp8` (its JSON output)."""
    f = lambda v: ", ".join(f"{x:.4f}" for x in v)  # noqa: E731
    ok = lambda c: "met" if c else "NOT met"  # noqa: E731
    e2e, cos, agr = j["recall_end_to_end"], j["logits_cosine"]["all_positions"], j["argmax_agreement"]
    g, cut = j["greedy_continuation"], j["cutoff"]
    k = j["index_topk"]
    lines = [
        "## FP8 indexer mode (CPU backend)",
        "",
        "The FP8 indexer mode (`dz_model_params.indexer = DZ_INDEXER_FP8`) runs the DSA indexer with the arithmetic",
        "of DeepSeek's inference code: queries (per head) and keys rotated by the orthonormal Hadamard transform,",
        f"quantized to E4M3 with one scale per 128 dims (this model: {heads} heads of {dim} dims, "
        f"{'one scale per vector' if dim <= 128 else f'{dim // 128} scales per vector'}), the",
        "query scale folded into the head weight, ReLU(q.k) times weight summed over heads in high precision;",
        "the key cache holds E4M3 bytes and fp32 scales. This checkpoint has no `scale_fmt`, so scales are",
        "amax/448 (DeepSeek-V3.2's `ue8m0` power-of-two scales are measured as a variant).",
        "",
        f"Measured on the held-out text (`tools/train/prepare_data.sh`; {j['tokens']} tokens, {j['windows']} windows "
        f"of {j['window']}; dz built at commit {j['commit']}, this model):",
        "",
        "    tools/train/prepare_data.sh data && dz indexer-fp8 --text data/heldout.txt --json out.json",
        "",
        f"Recall is the fraction of the exact mode's top-{k} that the FP8 mode keeps, averaged over the rows with",
        f"more than {k} visible tokens (t >= {k}; {j['rows_per_layer']} rows per layer); below that both modes keep",
        "every token. End to end, both modes run the whole model (later layers see inputs that earlier",
        "selections changed); logits are compared at every position.",
        "",
        "| quantity (FP8 mode vs exact mode) | value | target | status |",
        "|---|---|---|---|",
        f"| top-{k} recall, mean over layers (end to end) | {e2e['mean']:.4f} | >= {FP8_RECALL_MIN} | "
        f"{ok(e2e['mean'] >= FP8_RECALL_MIN)} |",
        f"| logits cosine, mean over positions | {cos['mean']:.5f} | >= {FP8_COSINE_MIN} | "
        f"{ok(cos['mean'] >= FP8_COSINE_MIN)} |",
        f"| logits cosine, worst position | {cos['min']:.4f} | >= {FP8_COSINE_MIN} | {ok(cos['min'] >= FP8_COSINE_MIN)} |",
        "",
        f"Per layer (end to end): {f(e2e['per_layer'])}. Logits cosine: 1st percentile {cos['p1']:.4f}, "
        f"{100 * cos['fraction_below_0.999']:.1f}% of positions below 0.999, {100 * cos['fraction_below_0.99']:.1f}% "
        f"below 0.99. Next-token argmax agreement {agr['all_positions']:.4f}; {g['tokens']}-token greedy continuations "
        f"of each window's first half identical in {100 * g['identical_fraction']:.1f}% of windows (mean common prefix "
        f"{g['mean_common_prefix']:.1f} tokens).",
        "",
        "Which step loses what: the exact run's indexer inputs of every layer scored again in float64 with one",
        "number format at a time (recall against the exact top-k on the same inputs):",
        "",
        "| representation of q and k | mean | per layer |",
        "|---|---|---|",
    ]
    for name, v in j["recall_same_inputs_float64_variants"].items():
        lines.append(f"| {name} | {v['mean']:.4f} | {f(v['per_layer'])} |")
    kr = j["recall_same_inputs_fp8_kernel"]
    var = j["recall_same_inputs_float64_variants"]
    kv_only, unrot = var["e4m3 k, bf16 q, rotated"]["mean"], var["e4m3 q,k not rotated"]["mean"]
    bf16 = var["bf16 q,k"]["mean"]
    lines += [
        "",
        f"The FP8 kernel itself on the same inputs: {kr['mean']:.4f} (float64 \"e4m3 q,k rotated\": "
        f"{var['e4m3 q,k rotated']['mean']:.4f}); the exact kernel agrees with float64 scoring at "
        f"{j['recall_exact_kernel_vs_float64']['mean']:.4f}.",
        "",
        ("What limits the recall" if e2e["mean"] >= FP8_RECALL_MIN else "Why the target is missed")
        + ": at the cutoff the k-th and (k+1)-th exact scores are a median "
        f"{100 * cut['median_gap_over_top_score']:.2f}% of the row's top score apart, while E4M3 (4 significant bits)",
        f"moves a score by a median RMS of {100 * cut['median_rms_fp8_score_change_over_top_score']:.2f}% "
        f"(largest change per row: median {100 * cut['median_max_fp8_score_change_over_top_score']:.1f}%) of it, so",
        f"{k * (1 - e2e['mean']):.2f} of the {k} kept tokens swap per row on average ({100 * cut['rows_where_2x_change_exceeds_gap']:.1f}% of rows "
        "have a gap smaller than twice their largest change; the lowest exact rank the FP8 mode kept anywhere was",
        f"{cut['worst_exact_rank_kept_by_fp8']}). E4M3 keys alone (queries BF16) keep {kv_only:.4f}; not rotated, "
        f"the mode keeps {unrot:.4f}; BF16 queries",
        f"and keys would keep {bf16:.4f}. The mode follows the production arithmetic, so what it loses is the",
        "format's: "
        + ("the recall target is met" if e2e["mean"] >= FP8_RECALL_MIN else "the recall target is not met")
        + "; the logits target is met on the mean"
        + (", and at every position." if cos["min"] >= FP8_COSINE_MIN else ", not at every position."),
        "",
        "`tests/test_deepseek_v32.cpp` checks on the first 4 windows of the Devil's Dictionary part of the held-out",
        "text (`tests/data/dayzero_tiny/heldout_devil.txt`) that every FP8 selection of every layer is the top-k of",
        "the FP8 scores evaluated in float64, and the targets: recall >= 0.99 (each layer >= 0.985) and logits",
        "cosine >= 0.999 on the mean, with floors under the measured worst position and agreement.",
        "On the untrained random-weight fixtures (`tests/data/deepseek_v32_{bf16,fp8}`, top-16) the same mode keeps",
        "less (rows t >= k: layer 0 0.975-0.978 on identical inputs, layers 1-2 0.76-0.90; the test",
        "`deepseek_v32: FP8 indexer mode ... against exact mode` prints them): their score rows are near-ties.",
        "",
    ]
    return lines


def indexer_size_section(j):
    """Markdown lines: the FP8 mode's recall at other indexer sizes and trainings (`dz indexer-fp8` per model)."""
    runs = j["runs"]
    r0 = runs[0]
    mean = lambda v: v["mean"] if isinstance(v, dict) else v  # noqa: E731
    lines = [
        "### Indexer size and training",
        "",
        "DeepSeek-V3.2's indexer has 64 heads of 128 dims, as this model's has. The previous default model had 4 of 32",
        "and kept 0.9835 end to end. Does the FP8 recall grow with the indexer? Same-input recall (the FP8 kernel on the",
        "exact run's indexer inputs, against the exact top-k of the same inputs) depends only on the indexer's",
        "inputs and weights, so it was measured with that model's trained indexer and with random indexers",
        "of 4 x 32, 16 x 64 and 64 x 128 on its real hidden states (`tools/train/random_indexer.py`: Gaussian",
        f"weights, everything else unchanged), on the first {r0['windows']} windows of {r0['window']} held-out tokens "
        f"(rows t >= k; commit {r0['commit']}):",
        "",
        "    python3 tools/train/random_indexer.py --src MODEL --out m64 --heads 64 --dim 128",
        f"    dz indexer-fp8 --model m64 --text data/heldout.txt --windows {r0['windows']} --json out.json",
        "",
        "| indexer (heads x dim) | FP8 kernel, same inputs | e4m3 k only | e4m3 q only | not rotated | bf16 q,k "
        "| cutoff gap / top (median) | FP8 RMS change / top (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        v, c = r["recall_same_inputs_float64_variants"], r["cutoff"]
        lines.append(
            f"| {r['index_n_heads']} x {r['index_head_dim']}, {r['indexer'].split(' (')[0]} "
            f"| {mean(r['recall_same_inputs_fp8_kernel']):.4f} | {v['e4m3 k only, rotated']['mean']:.4f} "
            f"| {v['e4m3 q only, rotated']['mean']:.4f} | {v['e4m3 q,k not rotated']['mean']:.4f} "
            f"| {v['bf16 q,k']['mean']:.4f} | {100 * c['median_gap_over_top_score']:.2f}% "
            f"| {100 * c['median_rms_fp8_score_change_over_top_score']:.2f}% |")
    lines += [
        "",
        "With random projections the recall does not grow with the indexer: the score's spread near the cutoff and",
        "the E4M3 change of a score both scale the same way with heads and dims (sums of independent terms), so",
        "their ratio, and the recall, stay put. (End to end, a random indexer's poor selections shift later",
        "layers' inputs, so only same-input numbers are comparable here.) Trained indexers differ: their heads",
        "agree with one another, and the longer the indexer trains the further apart its scores at the cutoff.",
        "Trained models (`train_dsv32.py`, one H200; `dz indexer-fp8` on all held-out windows, rows t >= k):",
        "",
        "| model | training | held-out ppl (MXFP4) | indexer recall vs dense attention | FP8 recall end to end "
        "| same inputs | logits cosine mean | cutoff gap / top (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in j["trained"]:
        f = t["fp8"]
        lines.append(
            f"| {t['label']} | {t['training']} | {t['heldout_ppl_mxfp4_experts']:.1f} "
            f"| {t['indexer_recall_vs_dense_topk']:.4f} | **{mean(f['recall_end_to_end']):.5f}** "
            f"| {mean(f['recall_same_inputs_fp8_kernel']):.4f} | {f['logits_cosine']['all_positions']['mean']:.5f} "
            f"| {100 * f['cutoff']['median_gap_over_top_score']:.2f}% |")
    lines += ["", j["conclusion"], ""]
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--metrics", default="tests/data/dayzero_tiny/metrics.json")
    ap.add_argument("--indexer-fp8", default="tests/data/dayzero_tiny/indexer_fp8.json")
    ap.add_argument("--indexer-sizes", default="tests/data/dayzero_tiny/indexer_fp8_sizes.json")
    ap.add_argument("--out", default="docs/precision.md")
    a = ap.parse_args()
    m = json.load(open(a.metrics))
    pb, pm = m["heldout_ppl_bf16_experts"], m["heldout_ppl_mxfp4_experts"]
    agr, rec = m["next_token_agreement_bf16_vs_mxfp4"], m["indexer_recall_vs_dense_topk"]
    ok = lambda c: "met" if c else "NOT met"  # noqa: E731
    per_layer = ", ".join(f"layer {k} {v:.3f}" for k, v in sorted(m["indexer_recall_per_layer"].items()))
    rand = float(str(m.get("random_selection_recall", "nan")).split(":")[-1])
    lines = [
        "# Precision of the default model",
        "",
        "Generated by `tools/train/precision_report.py` from `tests/data/dayzero_tiny/metrics.json`, which",
        "`tools/train/train_dsv32.py` wrote when it trained `models/dayzero-tiny` (DeepSeek-V3.2 architecture:",
        f"MLA, DSA lightning indexer, MoE; {m['params'] / 1e6:.2f}M parameters of which {m['routed_expert_params'] / 1e6:.2f}M "
        f"in routed experts; vocabulary {m['vocab']}; trained {m['steps']} steps, "
        f"{m['train_tokens_seen'] / 1e6:.1f}M tokens, context {m['context']}, index_topk {m['index_topk']}).",
        f"Measured with transformers {m['transformers']} / PyTorch {m['torch']} in float32 on the held-out text",
        f"({m['heldout_eval_tokens']} tokens, windows of {m['context']}, sparse attention as shipped).",
        "",
        "| quantity | BF16 experts | MXFP4 experts | bound | status |",
        "|---|---|---|---|---|",
        f"| held-out perplexity | {pb:.3f} | {pm:.3f} | MXFP4/BF16 <= {PPL_RATIO_MAX} (is {pm / pb:.3f}) | "
        f"{ok(pm / pb <= PPL_RATIO_MAX)} |",
        f"| next-token agreement (argmax) | - | {agr:.4f} | >= {AGREEMENT_MIN} | {ok(agr >= AGREEMENT_MIN)} |",
        "",
        "The perplexity and recall bounds were set before training; the agreement bound was set after the first",
        "run, so it only guards against regressions.",
        "",
        "| indexer | value | bound | status |",
        "|---|---|---|---|",
        f"| top-{m['index_topk']} recall against the dense attention's top-{m['index_topk']} (head-summed, "
        f"rows t >= {m['index_topk']}) | {rec:.4f} | >= {RECALL_MIN} | {ok(rec >= RECALL_MIN)} |",
        "",
        f"Per layer: {per_layer}. A random choice of {m['index_topk']} causal keys would reach {rand:.3f}.",
        "",
        f"The model is small and trained for minutes: its final training loss is {m['final_train_lm_loss']:.2f} "
        f"(perplexity {math.exp(m['final_train_lm_loss']):.1f})",
        "against the held-out perplexity above, i.e. it has largely memorised its ~1.4M training tokens. It is a",
        "demonstration and test model, not a useful language model.",
        "",
        "What the columns mean: \"BF16 experts\" is the trained model rounded to BF16 everywhere; \"MXFP4",
        "experts\" quantizes only the routed experts to MXFP4 (E2M1 with one E8M0 scale per 32) as the shipped",
        "checkpoint holds them, everything else BF16. The indexer was trained with the KL objective against",
        "the main attention (dense warm-up, then sparse) and its recall is measured in float32 on held-out text.",
        "",
        "The dayzero CPU backend reproduces transformers on this checkpoint (exact indexer mode): per-position",
        "logits cosine >= 0.99999 and equal 12-token greedy continuations for two prompts",
        "(`tests/test_default_model.cpp`, reference in `tests/data/dayzero_tiny/reference.safetensors`).",
        "",
    ]
    fp8 = os.path.exists(a.indexer_fp8)
    if fp8:
        lines += fp8_indexer_section(json.load(open(a.indexer_fp8)), m["index_n_heads"], m["index_head_dim"])
        if os.path.exists(a.indexer_sizes):
            lines += indexer_size_section(json.load(open(a.indexer_sizes)))
    lines += [
        "## Not measured here",
        "",
        "- The MXFP4 -> FP8 E4M3 expert folding and FP8 GEMMs of the CUDA backend on this model.",
    ]
    if not fp8:
        lines += ["- The FP8 indexer mode (Hadamard rotation + E4M3 keys) on this model: its top-k recall against the",
                  "  exact indexer and the resulting logits."]
    lines += [
        "- The CUDA backend's logits on this model; contexts longer than the training context "
        f"({m['context']} tokens).",
        "",
    ]
    open(a.out, "w").write("\n".join(lines))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
