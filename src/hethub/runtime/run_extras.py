"""What ``hethub.train`` does besides stepping: start from a Hugging Face folder, the data source,
held-out evaluation, TensorBoard, the checkpoint metadata that makes a resume continue exactly, and
the final Hugging Face export. Kept out of ``train.py`` so the entry point stays a short loop.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hethub.runtime.checkpoint import Resumed
from hethub.runtime.checkpoint_io import read_manifest
from hethub.runtime.data import BatchSource, byte_tokenize, hf_tokenizer, load_tokens
from hethub.runtime.trainer import Trainer


@dataclass
class RunExtras:
    trainer: Trainer
    args: argparse.Namespace
    source: Any  # global_batch_at(step) -> [global_batch, seq_len + 1] tokens
    eval_batches: list[torch.Tensor] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # saved in every checkpoint's manifest
    tb: Any = None

    @property
    def logs(self) -> bool:
        return self.trainer.rank == self.trainer.topo.log_rank

    def say(self, text: str) -> None:
        if self.logs:
            print(f"hethub.train: {text}", flush=True)

    def after_step(self, step: int, rec: dict[str, Any] | None) -> None:
        """Collective when an evaluation is due: every rank calls it after every step. Adds
        ``eval_loss`` to the step's record (the log rank's) and writes TensorBoard scalars."""
        every = self.args.eval_every
        if every and ((step + 1) % every == 0 or step + 1 == self.args.steps):
            from hethub.runtime.evaluation import evaluate

            loss = evaluate(self.trainer, self.eval_batches)
            self.say(f"step {step}: held-out loss {loss:.4f} ({len(self.eval_batches)} batches)")
            if rec is not None:
                rec["eval_loss"] = loss
                rec["eval_tokens"] = len(self.eval_batches) * self.trainer.plan.tokens_per_step
        if rec is not None and self.tb is not None:
            for key in ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
                if key in rec:
                    self.tb.add_scalar(f"train/{key}" if key != "eval_loss" else "eval/loss", rec[key], step)
            self.tb.flush()

    def check_resume(self, resumed: Resumed | None) -> None:
        """Warn when the checkpoint resumed from (exactly the one loaded, which after a fallback is not
        the newest) was trained on other data (its position then means other sequences)."""
        if resumed is None or resumed.step == 0 or not self.logs:
            return
        step_dir = resumed.path
        saved = read_manifest(step_dir).get("meta", {}).get("data", {})
        now = self.meta.get("data", {})
        if saved.get("fingerprint") != now.get("fingerprint") or saved.get("shuffle_seed") != now.get("shuffle_seed"):
            self.say(f"warning: {step_dir} was trained on other data or another order (data fingerprint "
                     f"{str(saved.get('fingerprint'))[:12]} vs {str(now.get('fingerprint'))[:12]} now); training "
                     "continues at the same step of the new data")

    def finish(self, *, trained: bool) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.args.export_hf and self.trainer.rank == 0:
            from hethub.runtime.hf_io import export_checkpoint

            out = export_checkpoint(self.args.checkpoint_dir, self.args.export_hf, flag="--export-hf")
            print(f"hethub.train: exported the {'final' if trained else 'latest'} checkpoint as a Hugging Face "
                  f"folder: {out}", flush=True)


def _tensorboard(logdir: str | None, *, logs: bool) -> Any:
    if not logdir or not logs:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the optional 'tensorboard' package
    except ImportError:
        print("hethub.train: note: tensorboard is not installed; metrics go to the JSONL file only", flush=True)
        return None
    return SummaryWriter(log_dir=logdir)


def _stdlib_tokenize(name: str | None, *, vocab_size: int) -> Callable[[bytes], list[int]]:
    """Tokenizer of the default corpus: bytes, a tokenizer.json (file or folder), or a local Hugging
    Face tokenizer name."""
    if not name:
        return byte_tokenize
    p = Path(name)
    if p.suffix == ".json" or (p / "tokenizer.json").is_file():
        from hethub.runtime.tokenizer import check_fits, load_tokenizer

        tok = load_tokenizer(p)
        check_fits(tok, vocab_size=vocab_size)
        return lambda text: tok.encode(text.decode("utf-8", errors="replace"))
    return hf_tokenizer(name, vocab_size=vocab_size)


def _barrier(trainer: Trainer) -> None:
    trainer.comm.barrier()


def setup(args: argparse.Namespace, trainer: Trainer) -> RunExtras:
    """Collective: load the initial weights, build (or reuse) the token file, pick the held-out batches."""
    plan = trainer.plan
    meta: dict[str, Any] = {}
    extras = RunExtras(trainer=trainer, args=args, source=None, meta=meta)
    if args.init_from:
        from hethub.runtime.hf_io import check_spec_matches, load_stage

        meta["hf_config"] = check_spec_matches(plan.model, args.init_from, seq_len=plan.seq_len)
        stats = load_stage(trainer.model, args.init_from)
        trainer.refresh_masters()  # the fp32 master copies were taken from the initial weights
        extras.say(f"initialised from {args.init_from} (this rank read {stats.tensors} tensors, "
                   f"{stats.bytes_read / 2**20:.1f} MiB)")
    if args.data:
        from hethub.runtime.dataset import DataConfig, PackedDataset, build_token_file
        from hethub.runtime.tokenizer import check_fits, load_tokenizer

        tok = load_tokenizer(args.tokenizer, eos_token=args.eos_token)
        check_fits(tok, vocab_size=plan.model.vocab_size)
        cfg = DataConfig(files=tuple(args.data), format=args.data_format, text_field=args.text_field,
                         cache_dir=args.data_cache, eval_sequences=args.eval_sequences,
                         shuffle_seed=args.shuffle_seed)
        # One writer per node (the cache may be node-local); the others then find its file.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            tf = build_token_file(cfg, tok)
            extras.say(f"data: {tf.num_documents} documents, {tf.num_tokens:,} tokens "
                       f"({'cached' if tf.reused else 'tokenised now'}: {tf.path})")
        _barrier(trainer)
        tf = build_token_file(cfg, tok)
        ds = PackedDataset(tf.tokens(), seq_len=plan.seq_len, global_batch=plan.global_batch,
                           eval_sequences=args.eval_sequences, shuffle_seed=args.shuffle_seed)
        extras.source = ds
        extras.eval_batches = ds.eval_batches(max_batches=args.eval_batches)
        if args.eval_every and not extras.eval_batches:
            from hethub.errors import RuntimeSetupError

            raise RuntimeSetupError(f"--eval-sequences {args.eval_sequences} holds out less than one global batch "
                                    f"({plan.global_batch} sequences). Fix: hold out at least {plan.global_batch}.")
        meta["data"] = {"fingerprint": tf.fingerprint, "shuffle_seed": args.shuffle_seed,
                        "eval_sequences": args.eval_sequences, "train_sequences": ds.num_train}
    else:
        tokenize = _stdlib_tokenize(args.tokenizer, vocab_size=plan.model.vocab_size)
        extras.source = BatchSource(load_tokens(num_tokens=args.steps * plan.global_batch * (plan.seq_len + 1),
                                                tokenize=tokenize), global_batch=plan.global_batch,
                                    seq_len=plan.seq_len)
    extras.tb = _tensorboard(args.tensorboard, logs=extras.logs)
    return extras
