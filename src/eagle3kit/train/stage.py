"""Stage ``train``: EAGLE-3 with training-time test (docs/conventions.md, alignment).

Data: ``tokens.safetensors`` + ``vocab.safetensors`` + the target (its states computed here), stored
features (``train.features``) or capture servers (``train.online_from``, online training). Where
``train.feature_cache`` and the memory plan put them (:mod:`eagle3kit.train.memory`: the device, pinned
host memory), the target runs once over every sample and its aux states, post-norm last hidden state
and full-vocabulary argmax are kept for all epochs (not full-vocabulary logits: 197 KB a token for a 49K
vocabulary); where they fit nowhere, the target runs inside every step.

Per TTT step k (0-based), position t is supervised when its input token x_{t+k+1} is a
completion token and the target's argmax at t+k+1 lies in the draft vocabulary; the label is the
target's softmax at t+k+1 restricted to the draft vocabulary (fp32). Loss = Σ_k w^k · CE_k, each
CE_k normalised by its own number of supervised positions (a step with none contributes 0, never
NaN). Logged per step: loss, per-step top-1 agreement, and the acceptance length it implies,
1 + Σ_k Π_{j≤k} acc_j.

Every epoch: simulated τ on the held-out validation split (greedy chain, K = ``evaluate.k``);
the best epoch is kept as ``checkpoints/best.safetensors``. Resume: ``checkpoints/last.*`` holds
model, optimizer, scheduler, epoch and RNG state; a rerun continues after the last finished epoch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import time
from pathlib import Path

import torch

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.kinds import DrafterKind, kind_for_config
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.metrics import AcceptanceStats
from eagle3kit.core.rundir import (
    REWRITE,
    DataError,
    RunDir,
    load_safetensors,
    open_safetensors,
    require_free,
    sha256_json,
    sha256_tensors,
)
from eagle3kit.core.ui import Timer, console, progress
from eagle3kit.data.tokenize import load_shard
from eagle3kit.model.draft_vocab import load_vocab
from eagle3kit.model.target import (
    Target,
    chat_template_hash,
    load_target,
    pick_device,
    resolve_aux_layer_ids,
    teacher_logits,
    teacher_top1_lse,
    tokenizer_hash,
)
from eagle3kit.model.target_files import weights_fingerprint
from eagle3kit.model.target_head import load_target_head
from eagle3kit.train.batches import Sample, length_batches, packed_batches
from eagle3kit.train.checkpoints import (
    _set_aside,
    init_from_drafter,
)
from eagle3kit.train.distributed import full_state, init_world, load_full_state, parallel_mode
from eagle3kit.train.extract import engine_features, feature_inputs
from eagle3kit.train.features import load_features
from eagle3kit.train.log import TrainLog
from eagle3kit.train.memory import MemoryPlan, print_plan, training_plan
from eagle3kit.train.online import EngineFeeder, sample_key, server_version
from eagle3kit.train.samples import compute_features, trained_settings, warmup_cosine
from eagle3kit.train.transport import bytes_per_token
from eagle3kit.train.ttt import implied_tau


@torch.no_grad()
def fill_engine_features(
    target: Target, samples: list[Sample], states: list[torch.Tensor], device, lse=False
):
    """Fill ``aux``, ``last`` and ``argmax`` (and ``lse``) of ``samples`` from an engine's captured
    states, one [T, 4, Ht] per sample (:func:`~eagle3kit.train.extract.engine_features`: the final
    norm applied once here), the teacher's top-1 taken at completion tokens as
    :func:`compute_features` takes it."""
    for s, h in zip(samples, states):
        aux, last = engine_features(target, h)
        top1, norm = teacher_top1_lse(target, last, where=s.mask.bool())
        s.aux, s.last, s.argmax = aux.to(device), last.to(device), top1.to(device)
        s.lse = norm.to(device) if lse else None


def feature_source_warning(source: str | None, serve_engine: str | None) -> str | None:
    """The warning when training features come from another source than the serving engine: a
    drafter trained on one engine's numerics and served by another's loses acceptance.
    ``source`` is the features' tag (``vllm 0.32.0 (…)``; None = the transformers backend)."""
    src = source or "transformers (the target loaded by eagle3kit)"
    if serve_engine is None or src.split()[0] == serve_engine:
        return None
    fix = (
        "extract them with `eagle3kit extract --backend vllm`, or compare the two sources with `eagle3kit parity` "
        "before a long run"
        if serve_engine == "vllm"
        else "eagle3kit has no SGLang capture backend, so the difference cannot be measured here: check τ in SGLang "
        "(`eagle3kit bench`) before a long run"
    )
    return (
        f"train: the features come from {src}, but train.serve_engine is {serve_engine}: their numerics can differ "
        f"(quantization, kernels, pre/post-norm states); {fix}"
    )


# optimizer steps of a run left out of its steady tokens/s (flex attention's compilation, the
# allocator's and autotuner's warm-up)
WARM_STEPS = 3
ENGINE_CHECK = 16  # online: samples whose engine token is compared with this target's argmax


def _flat(b) -> list[int]:
    """A batch's sample indices (a packed batch's rows flattened)."""
    return [i for r in b for i in (r if isinstance(r, list) else [r])]


def _epoch_batches(train: list[Sample], tc, epoch: int) -> list:
    """This epoch's batches (seeded by ``train.seed`` + epoch: the same on every run and resume)."""
    lengths = [s.ids.numel() for s in train]
    rng = random.Random(tc.seed + epoch)
    if tc.pack_length:
        return packed_batches(lengths, tc.tokens_per_step, tc.pack_length, True, rng)
    mix = random.Random(f"{tc.seed}:{epoch}:samples") if tc.shuffle == "samples" else None
    return length_batches(lengths, tc.tokens_per_step, True, rng, mix)


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _truncate_log(path: Path, last_step: int) -> None:
    """Drop log records past ``last_step`` (steps a killed run logged after its last checkpoint;
    the resumed run logs them again)."""
    if not path.exists():
        return
    keep = [
        ln
        for ln in path.read_text().splitlines()
        if ln.strip() and json.loads(ln).get("step", 0) <= last_step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    tmp.replace(path)


def run_train(cfg: Config, run: RunDir, target: Target | None = None) -> dict:
    """Train the drafter; writes ``checkpoints/``, ``train_log.jsonl`` and ``tensorboard/``; returns
    the report section.

    Under ``torchrun`` (see :mod:`eagle3kit.train.distributed`) every process trains on its own share of
    the training samples with the drafter in DistributedDataParallel; rank 0 validates, writes
    checkpoints, the log and the report. Resume: ``checkpoints/last.safetensors`` +
    ``train_state.pt`` (optimizer, scheduler, data position within the epoch, RNG state) written
    at the end of every epoch and every ``train.checkpoint_every`` steps; a rerun with the same
    inputs continues from there and logs the same loss curve an uninterrupted run would.

    Raises:
        ConfigError: missing stage outputs, a vocabulary or tokenizer made for another target, no
        supervised tokens. DataError: another ``eagle3kit train`` holds this run directory (rank 0
        holds ``.train.lock`` while it trains, so two trainings never write the same checkpoints).
    """
    kind = kind_for_config(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: the other ranks write nothing of their own
        return _run_train(cfg, run, target, kind)
    with run.lock("train"):
        return _run_train(cfg, run, target, kind)


def _run_train(cfg: Config, run: RunDir, target: Target | None, kind: DrafterKind) -> dict:
    """The stage as named steps (:class:`_Training` holds what they share), for any drafter ``kind``."""
    t = _Training(cfg, run, target, kind)  # resolve inputs: files, vocab, target, samples, features, split
    t.build()  # the drafter, init_from, optimizer and schedule
    t.restore()  # resume from checkpoints/last.*, or set foreign ones aside
    if t.start_epoch >= t.tc.epochs:
        if t.world.main:
            console.print("[green]train: all epochs already done")
        done = run.report.get("train")
        if done and not t.swapped:  # checkpoints put back: the report is theirs, written again
            return done
    t.prepare()  # pending mark, the feature cache, the log
    for epoch in range(t.start_epoch, t.tc.epochs):
        sums = t.train_epoch(epoch)
        t.validate(epoch, sums)  # val τ, the best checkpoint, last.* for resume
    return t.write()  # report.json and the manifest


class _Training:
    """One ``train`` run's state, shared by the steps of :func:`_run_train`; what
    differs between drafter kinds (the drafter, its step, its validation, its checkpoint) is asked of
    ``kind`` (:class:`~eagle3kit.core.kinds.DrafterKind`).

    Attributes set by ``__init__`` (resolved inputs): ``world``, ``device``, ``speed``, ``target``,
    ``vocab``, ``aux_ids``, ``samples`` (every sample with a supervised token), ``train``/``val``
    (this process's share; validation on rank 0, or on every rank under FSDP), ``features`` (the
    extracted-features index or None), ``inputs`` (hashed into ``train_state.pt``: a resume needs
    the same), ``provenance`` (stored in every checkpoint). By :meth:`build`: ``drafter``,
    ``model`` (wrapped for DDP/FSDP), ``opt``, ``sched``. By :meth:`restore`: ``start_epoch``,
    ``start_batch``, ``history``, ``best``, ``acc_state``.
    """

    def __init__(self, cfg: Config, run: RunDir, target: Target | None, kind: DrafterKind):
        self.cfg, self.run, self.tc, self.kind = cfg, run, cfg.train, kind
        tc = self.tc
        if tc.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "train.wandb_project is set but wandb is not installed; pip install 'eagle3kit[wandb]' "
                "or unset train.wandb_project"
            )
        self.world = world = init_world(pick_device(tc.device))
        self.device = device = world.device
        kind.check_training(cfg, world.size)
        self.speed = kind.speed(tc, device, cfg.vocab.draft_vocab_size)
        shard = run.require("tokens.safetensors", "tokenize")
        self.vocab_path = run.require("vocab.safetensors", "vocab")
        fingerprint = (
            target.source.get("weights_fingerprint")
            if target is not None
            else weights_fingerprint(cfg.target)
        )
        self.consumed = check_inputs(
            run, "train", ["tokens.safetensors", "vocab.safetensors"], target=fingerprint
        )
        self.vocab, vocab_meta = load_vocab(self.vocab_path, expected_size=cfg.vocab.draft_vocab_size)
        if target is None:  # fed by the engine: only the embedding, final norm and lm_head are needed
            target = (load_target_head if tc.online_from else load_target)(cfg.target, device=device)
        self.target = target
        if self.vocab.vocab_size != target.vocab_size:
            raise ConfigError(
                f"{self.vocab_path} was built for a vocabulary of {self.vocab.vocab_size}, the target has "
                f"{target.vocab_size}"
            )
        tok_hash = tokenizer_hash(target.tokenizer)
        for path, meta in ((self.vocab_path, vocab_meta), (shard, open_safetensors(shard).metadata() or {})):
            if meta.get("tokenizer_sha256") not in (None, tok_hash):
                raise ConfigError(
                    f"{path} was built with another tokenizer than {cfg.target.model}'s; "
                    "rerun `eagle3kit tokenize` and `eagle3kit vocab` for this target"
                )
            if meta.get("chat_template_sha256") not in (None, chat_template_hash(target.tokenizer)):
                raise ConfigError(
                    f"{path} was rendered with another chat template than {cfg.target.model}'s (the template "
                    f"changed since `eagle3kit tokenize`); rerun `eagle3kit tokenize --run-dir {run.path}`, then vocab"
                )
        self.aux_ids = aux_ids = resolve_aux_layer_ids(cfg.target, target.num_layers, cfg.drafter)
        all_samples = [Sample(ids, mask) for ids, mask in load_shard(shard)]
        tokens_sha, vocab_sha = self.consumed["tokens.safetensors"], self.consumed["vocab.safetensors"]
        self._split(all_samples, shard)
        source = "stored" if tc.features else ("servers" if tc.online_from else None)
        self.memory = self._plan_memory(source)  # where the states go, or a plan that does not fit refused
        self.features = self._stored(all_samples, tokens_sha, vocab_sha) if tc.features else None
        if self.features is not None:
            kind.check_features(cfg, self.features)
        self.feeder = self._online(tc, target, aux_ids) if tc.online_from else None
        self.engine_agree = [0, 0]  # samples whose engine token equals this target's argmax, of those checked
        warning = feature_source_warning(self._features_source(), tc.serve_engine)
        if warning and world.main:
            console.print(f"[yellow]{warning}[/]")
        self._record_inputs(tokens_sha, vocab_sha, tok_hash)
        self.ckpt = run / "checkpoints"
        self.ckpt.mkdir(exist_ok=True)
        self.state_path = self.ckpt / "train_state.pt"
        self.log_path = run / "train_log.jsonl"

    def _stored(self, all_samples: list[Sample], tokens_sha: str, vocab_sha: str) -> dict:
        """Fill every sample from ``train.features`` (the shards index all of them), in one place with the
        validation states: the device only when the plan puts both there; returns the index's inputs."""
        tc, target = self.tc, self.target
        both = (self.memory.cache, self.memory.val) == ("device", "device")
        features = load_features(
            tc.features,
            all_samples,
            feature_inputs(tokens_sha, self.aux_ids, target, vocab_sha),
            target,
            self.device if both else torch.device("cpu"),
        )
        if self.world.main:
            console.print(
                f"train: features from {tc.features} ({features.get('dtype')}, teacher "
                f"{features.get('teacher')}); the target runs only for validation"
            )
        return features

    def _plan_memory(self, source: str | None) -> MemoryPlan:
        """What this process will hold on its device (:func:`~eagle3kit.train.memory.training_plan`,
        the drafter's shapes from a copy on the ``meta`` device), printed by rank 0; the feature
        cache and validation states placed. Raises ConfigError for a plan that does not fit."""
        tc = self.tc
        params, shape = self.kind.shaped(self.cfg, self.target, self.vocab, self.aux_ids)
        plan = training_plan(
            tc,
            self.speed,
            self.target,
            params,
            len(self.aux_ids),
            shape,
            self.train,
            self.val,
            self.device,
            self.world.size,
            source,
        )
        if self.world.main:
            print_plan(plan)
        if self.device.type == "cuda":  # the measured peak of this stage, for the report
            torch.cuda.reset_peak_memory_stats(self.device)
        return plan

    def _record_inputs(self, tokens_sha: str, vocab_sha: str, tok_hash: str) -> None:
        """``inputs`` (what a resume must share: data, vocab, aux ids, train settings, target, world
        size, features) and ``provenance`` (stored in every checkpoint, read by export and check)."""
        self.tc_fields = trained_settings(self.cfg)  # what is trained (hashed, stored, diffed)
        self.inputs = {
            "tokens": tokens_sha,
            "vocab": vocab_sha,
            "aux_layer_ids": list(self.aux_ids),
            "train_config": sha256_json(self.tc_fields),
            "target": self.target.source.get("weights_fingerprint"),
            "world_size": self.world.size,
        }
        if self.features is not None:
            self.inputs["features"] = sha256_json(self.features)
        if self.feeder is not None:  # the producing engine (not its address: a restarted server resumes)
            self.inputs["features"] = sha256_json({"online": self._features_source()})
        self.provenance = {
            "target": {
                "model": self.cfg.target.model,
                "weights_fingerprint": self.target.source.get("weights_fingerprint"),
                "fingerprint_format": self.target.source.get("fingerprint_format"),
            },
            "tokenizer_sha256": tok_hash,
            "draft_vocab_sha256": self.inputs["vocab"],
            "aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": list(self.aux_ids)},
            # where the aux states and the teacher came from (check compares it with the serving engine)
            "features_source": self._features_source() or "transformers",
        }

    def _features_source(self) -> str | None:
        """The features' tag (``vllm <version> (…)`` from ``extract`` or the online servers; None:
        the target loaded here)."""
        if self.feeder is not None:
            fp8 = ", fp8 through hs-connectors" if self.tc.online_transport == "fp8" else ""
            return f"vllm {self.online_version} (extract_hidden_states, eagle3kit.train.vllm_capture{fp8})"
        return (self.features or {}).get("source")

    def _online(self, tc, target: Target, aux_ids):
        """The :class:`~eagle3kit.train.online.EngineFeeder` of ``train.online_from`` (one buffer
        folder per process), after asking every server what it is.

        Raises:
            ConfigError: train.features set too, or servers of different vLLM versions or models.
            DataError: a server that does not answer."""
        if tc.features:
            raise ConfigError(
                "train.online_from and train.features both name where features come from; keep one"
            )
        seen = [server_version(u) for u in tc.online_from]
        if len({(v["version"], tuple(v["models"])) for v in seen}) > 1:
            raise ConfigError(f"train.online_from: the servers differ (vLLM version or model): {seen}")
        self.online_version, model = seen[0]["version"], seen[0]["models"][0]
        dtype_bytes = torch.tensor([], dtype=target.dtype).element_size()
        n_ids = len(aux_ids) + 1
        return EngineFeeder(
            tc.online_from,
            model,
            self.run.path / "online-buffer" / f"rank-{self.world.rank}",
            tc.online_buffer_bytes,
            n_ids,
            bytes_per_token(tc.online_transport, n_ids, target.hidden_size, dtype_bytes),
            tc.online_inflight,
            tc.online_timeout_s,
            tc.online_transport,
            [*aux_ids, target.num_layers],
        )

    def _store(self, place: str):
        """Where states placed at ``place`` (device or host) are kept: the device, or ``"host"``
        (pinned host memory, :class:`~eagle3kit.train.samples.HostStates`)."""
        return self.device if place == "device" or self.device.type != "cuda" else "host"

    def _fetch(self, samples: list[Sample], store=None) -> list[str]:
        """Fill ``samples`` from the online servers (their states arrive in the scheduled order),
        kept on ``store`` (default: the device); returns their keys
        (:func:`~eagle3kit.train.online.sample_key`)."""
        keys = [sample_key(s.ids) for s in samples]
        states = [self.feeder.get(k, s.ids) for k, s in zip(keys, samples)]
        where = torch.device("cpu") if store == "host" else (store or self.device)
        fill_engine_features(self.target, samples, states, where, lse=self.tc.loss != "kl")
        self._check_engine_tokens(keys, samples)
        return keys

    def _check_engine_tokens(self, keys: list[str], samples: list[Sample]) -> None:
        """The servers serve this target: the token each one generated after a sample equals the
        argmax of this target's lm_head over the captured last state there (ties aside), on at least
        half of the samples checked, from the 4th to the ENGINE_CHECK-th of this run (a server of
        other weights, or capturing another last layer, agrees on almost none).

        Raises:
            ConfigError: the agreement is below half, naming the servers and the fix."""
        seen = self.engine_agree
        for k, s in zip(keys, samples):
            nxt = self.feeder.engine_next.pop(k, None)
            if nxt is None or seen[1] >= ENGINE_CHECK:
                continue
            mine = int(teacher_logits(self.target, s.last[-1:]).argmax(-1))
            seen[0] += int(mine == nxt)
            seen[1] += 1
            if seen[1] >= 4 and seen[0] * 2 < seen[1]:  # from the 4th sample on (a resumed run's few too)
                raise ConfigError(
                    f"train.online_from {', '.join(self.tc.online_from)}: the server's next token after a "
                    f"sample equals this target's prediction from the captured states on {seen[0]} of "
                    f"{seen[1]} samples: it serves other weights than {self.cfg.target.model} (or captures "
                    "another last layer). Serve the same checkpoint, with "
                    "the command `eagle3kit capture-server -c CONFIG` prints for this run's config"
                )

    def _split(self, all_samples: list[Sample], shard) -> None:
        """The samples with a supervised token (ConfigError when none), a seeded validation split
        (``train.val_fraction``), then this process's share of the rest."""
        self.samples = [s for s in all_samples if s.mask[1:].any()]
        if not self.samples:
            raise ConfigError(f"{shard} holds no supervised tokens; check the tokenize stage's report")
        tc, world, samples = self.tc, self.world, self.samples
        order = list(range(len(samples)))
        random.Random(tc.seed).shuffle(order)
        self.n_val = n_val = (
            max(1, round(len(samples) * tc.val_fraction)) if tc.val_fraction > 0 and len(samples) > 1 else 0
        )
        # FSDP: all validate
        self.val = [samples[i] for i in order[:n_val]] if world.main or tc.parallel == "fsdp" else []
        self.train = [samples[i] for i in order[n_val:]][world.rank :: world.size]  # this process's share

    def build(self) -> None:
        """The drafter (seeded; from ``train.init_from`` when set), wrapped for the world, AdamW and
        the warmup + cosine schedule over every process's common number of steps."""
        tc, world, device = self.tc, self.world, self.device
        drafter = self.kind.build(self.cfg, self.target, self.vocab, self.aux_ids, self.samples)
        # last.safetensors (weights + AdamW's two moments), best, and one of them being written
        if world.main:
            require_free(
                self.ckpt, 8 * sum(p.numel() * 4 for p in drafter.parameters()), "train's checkpoints"
            )
        self.init = init = init_from_drafter(drafter, tc.init_from, self.cfg.target) if tc.init_from else None
        if init:
            self.inputs["init_from"] = self.provenance["init_from"] = init["init_from_sha256"]
            fresh = init["lm_head_rows"] - init["lm_head_rows_copied"]
            if world.main:
                console.print(
                    f"train: starting from {tc.init_from} ({init['lm_head_rows_copied']} of "
                    f"{init['lm_head_rows']} lm_head rows shared by target id"
                    + (f"; {fresh} start fresh)" if fresh else ")")
                )
        self.drafter = drafter = drafter.to(device)
        if self.speed["compile"]:
            drafter.compile_layer()
        self.model = world.wrap(drafter, tc.parallel)
        if world.size > 1 and world.main:
            console.print(
                f"train: world size {world.size} ({tc.parallel.upper()} on {device.type}): each process trains "
                f"its share of {len(self.samples) - self.n_val} samples"
            )
        self.draft_ids = self.vocab.ids.to(device)
        self.opt = torch.optim.AdamW(
            drafter.parameters(),
            lr=tc.lr,
            betas=tuple(tc.betas),
            weight_decay=tc.weight_decay,
            fused=device.type == "cuda",
        )
        # each epoch's optimizer steps, the same on every process (the fewest batches any has); an
        # epoch's batches are fixed by train.seed, so this is known before the first step, and with
        # train.shuffle: samples it can differ by a few between epochs
        self.epoch_steps = [world.min_int(len(_epoch_batches(self.train, tc, e))) for e in range(tc.epochs)]
        lr_at = warmup_cosine(sum(self.epoch_steps), tc.warmup_ratio)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_at)

    def restore(self) -> None:
        """Resume from ``checkpoints/last.safetensors`` + ``train_state.pt`` when they were made from
        the same inputs at the same step; else move ``checkpoints/`` to ``checkpoints.prev-N`` (and
        the same for a ``best.safetensors`` that is not the one train wrote)."""
        world, ckpt, state_path, log_path = self.world, self.ckpt, self.state_path, self.log_path
        # the best score so far: validation τ, or −train loss without validation (any first epoch beats it)
        self.start_epoch, self.start_batch, self.history = 0, 0, []
        self.best = {"val_tau": float("-inf"), "epoch": -1}
        self.acc_state = None
        best_rec = self.run.manifest.get("lineage", {}).get("checkpoints/best.safetensors") or {}
        swapped = self._swap_back() if world.main else None
        # every process learns it (a put-back run that is all done writes its report again)
        self.swapped = world.sum_floats([1.0 if swapped else 0.0])[0] > 0
        if (
            world.main
            and swapped is None
            and state_path.exists()
            and best_rec.get("sha256")
            and (ckpt / "best.safetensors").exists()
            and sha256_tensors(ckpt / "best.safetensors") != best_rec["sha256"]
        ):
            keep = _set_aside(ckpt, log_path)
            console.print(
                f"[yellow]train: checkpoints/best.safetensors is not the one train wrote (replaced or edited); "
                f"moved checkpoints/ to {keep} and starting fresh"
            )
        world.barrier()
        if not state_path.exists():
            return
        try:
            st = torch.load(state_path, weights_only=True)
        except Exception as e:  # truncated or foreign: an interrupted copy, a full disk
            raise DataError(
                f"{state_path} is unreadable ({type(e).__name__}); {REWRITE['last.safetensors']}"
            ) from None
        weights_step = None
        if (ckpt / "last.safetensors").exists():
            with open_safetensors(ckpt / "last.safetensors") as f:
                weights_step = (f.metadata() or {}).get("step")
        if (
            st.get("inputs") == self.inputs
            and weights_step is not None
            and weights_step == str(st.get("step"))
        ):
            self._resume(st)
            return
        world.barrier()
        if world.main:
            keep = _set_aside(ckpt, log_path)
            changed, hint = self._stale_inputs(st)
            console.print(
                f"[yellow]train: checkpoints/ were made from other inputs (changed: {', '.join(changed)}); "
                f"moved them to {keep} and starting fresh{hint}"
            )
        world.barrier()

    def _stale_inputs(self, st: dict) -> tuple[list[str], str]:
        """What differs between this run's inputs and those ``train_state.pt`` (``st``) was made
        from, as ``train.<field>`` names where the train config changed, and a hint on how to
        resume when the difference is one of the defaults that changed (the drafter variant, the optimizer and
        batches), an empty hint when none applies."""
        changed = sorted(
            k
            for k in set(self.inputs) | set(st.get("inputs", {}))
            if self.inputs.get(k) != st.get("inputs", {}).get(k)
        )
        old_tc = json.loads(st.get("train_config") or "{}")
        if "train_config" in changed and old_tc:
            changed.remove("train_config")
            changed += [
                f"train.{k}"
                for k in sorted(set(old_tc) | set(self.tc_fields))
                if old_tc.get(k) != self.tc_fields.get(k)
            ]
        if not changed:
            changed = [
                "last.safetensors is missing or from another step than train_state.pt (a kill during a save)"
            ]
        hint = ""
        if (
            "train.drafter" in changed
            and old_tc.get("drafter") is None
            and "drafter" not in self.cfg.model_fields_set
        ):
            hint = (
                " (they are a plain EAGLE-3 drafter's, and a config without a drafter section trains "
                "EAGLE-3.1: write drafter: {variant: eagle3} to resume them)"
            )
        if (
            old_tc.get("betas") == [0.9, 0.95]
            and old_tc.get("shuffle", "batches") == "batches"
            and {"train.betas", "train.shuffle"} & set(changed)
        ):
            hint += (
                " (they were trained with the optimizer and batches of before 2026-12-04: write train: "
                "{betas: [0.9, 0.95], shuffle: batches} to resume them)"
            )
        return changed, hint

    def _swap_back(self) -> Path | None:
        """When ``checkpoints/`` was made from other inputs (or holds none) and a set-aside
        ``checkpoints.prev-N`` was made from this run's inputs, put that one back (the newest such;
        its log and TensorBoard events too) and set the current one aside; returns the folder put
        back, or None. Main process only."""
        run_dir, ckpt = self.ckpt.parent, self.ckpt

        def inputs_of(folder: Path):
            sp = folder / "train_state.pt"
            if not sp.exists() or not (folder / "last.safetensors").exists():
                return None
            try:
                return torch.load(sp, weights_only=True, mmap=True).get("inputs")
            except Exception:  # unreadable: never swapped in
                return None

        if ckpt.exists() and inputs_of(ckpt) == self.inputs:
            return None
        prevs = [p for p in run_dir.glob(f"{ckpt.name}.prev-*") if p.name.rsplit("-", 1)[1].isdigit()]
        for prev in sorted(prevs, key=lambda p: int(p.name.rsplit("-", 1)[1]), reverse=True):
            if inputs_of(prev) != self.inputs:
                continue
            keep = None
            # the current attempt's checkpoints, or only its log and events (killed before its first
            # checkpoint): set aside, so the folder put back brings its own log
            stray = self.log_path.exists() or (run_dir / "tensorboard").exists()
            if (ckpt.exists() and any(ckpt.iterdir())) or stray:
                ckpt.mkdir(exist_ok=True)
                keep = _set_aside(ckpt, self.log_path)
            if ckpt.exists():
                ckpt.rmdir()  # empty (or just emptied by the move)
            prev.rename(ckpt)
            for name, dest in (("train_log.jsonl", self.log_path), ("tensorboard", run_dir / "tensorboard")):
                if (ckpt / name).exists() and not dest.exists():
                    (ckpt / name).rename(dest)
            console.print(
                f"[green]train: {prev.name}/ was made from this run's inputs; put it back as checkpoints/"
                + (f" (what was there, checkpoints or a log, moved to {keep.name}/)" if keep else "")
            )
            return prev
        return None

    def _resume(self, st: dict) -> None:
        """Load weights, optimizer, schedule, data position and RNG state from ``st`` (train_state.pt)."""
        tc, world = self.tc, self.world
        last = load_safetensors(self.ckpt / "last.safetensors", REWRITE["last.safetensors"])
        load_full_state(self.drafter, last, self.opt, st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        self.start_epoch, self.start_batch = st["next_epoch"], st["next_batch"]
        self.history, self.best = json.loads(st["history"]), json.loads(st["best"])
        self.acc_state = st["epoch_sums"][world.rank] if st.get("epoch_sums") else None
        torch.set_rng_state(st["rng"]["torch"])
        random.setstate(
            tuple(st["rng"]["python"]) if isinstance(st["rng"]["python"], list) else st["rng"]["python"]
        )
        if "cuda" in st["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["rng"]["cuda"])
        if world.main and self.start_epoch < tc.epochs:
            # past the ckpt
            _truncate_log(self.log_path, self.steps_before(self.start_epoch, self.start_batch))
            console.print(
                f"[green]train: resuming at epoch {self.start_epoch + 1} of {tc.epochs}, "
                f"step {self.start_batch} of {self.epoch_steps[self.start_epoch]}"
            )

    def steps_before(self, epoch: int, batch: int) -> int:
        """Optimizer steps taken before ``batch`` of ``epoch`` (0-based)."""
        return sum(self.epoch_steps[:epoch]) + batch

    def prepare(self) -> None:
        """Mark best.safetensors pending, fill the feature cache, open the log (TensorBoard, W&B)."""
        tc, world = self.tc, self.world
        if world.main:  # until it is recorded at the end, best.safetensors is unfinished to every later stage
            self.run.mark_pending(
                "checkpoints/best.safetensors",
                "train",
                self.consumed,
                self.target.source.get("weights_fingerprint"),
            )
        # optimizer steps already taken
        self.step = self.steps_before(self.start_epoch, self.start_batch)
        if self.step == 0 and world.main:
            # steps a run killed before its first checkpoint logged: they are redone
            _truncate_log(self.log_path, 0)
        self.timer = Timer()
        self.seconds = {"features": 0.0, "validation": 0.0}  # where the stage's clock went, besides the steps
        self.steady = [0, 0.0]  # tokens and seconds of this run's optimizer steps after its first WARM_STEPS
        self.cached = self.memory.cache != "off" and self.feeder is None
        if self.feeder is not None:
            self.consumed_path = self.run.path / "online-consumed" / f"rank-{world.rank}.jsonl"
            self.consumed_path.parent.mkdir(exist_ok=True)
            _truncate_log(self.consumed_path, self.step)  # steps after the last checkpoint are redone
        if self.feeder is not None:  # every feature from the servers (no process runs the target)
            if self.start_epoch < tc.epochs and self.val:
                # not pruned: the files a killed run fetched for this epoch's rest stay for its schedule below
                self.feeder.schedule([(sample_key(s.ids), s.ids) for s in self.val], prune=False)
                self._fetch(self.val, self._store(self.memory.val))  # kept for every epoch's validation
        elif self.start_epoch < tc.epochs and self.features is None:
            t_features = time.perf_counter()
            for group, place, label in (
                (self.train, self.memory.cache, "target features"),
                (self.val, self.memory.val, "validation states"),
            ):
                if group and place != "off":
                    compute_features(
                        self.target,
                        group,
                        self.aux_ids,
                        tc.tokens_per_step,
                        self.device,
                        self._store(place),
                        label=label,
                        lse=tc.loss != "kl",
                    )
            self.seconds["features"] += time.perf_counter() - t_features
        self.logger = TrainLog(
            self.run, tc, world.main, dict(self.speed, world_size=world.size), purge_step=self.step
        )
        # tests: emulate a kill after N steps
        self.stop_after = int(os.environ.get("EAGLE3KIT_STOP_AFTER_STEPS", "0"))
        self.trained_tokens, self.steps_run = 0, 0
        self.last_stats: dict = {}

    def save(self, next_epoch: int, next_batch: int, sums) -> None:
        """``last.safetensors`` + ``train_state.pt`` (whole, then renamed): resume continues at
        ``next_epoch``/``next_batch`` with each process's running epoch ``sums``."""
        world = self.world
        sums = world.gather_floats(sums) if sums is not None else None
        model_state, opt_state = full_state(self.drafter, self.opt)  # collective under FSDP
        if world.main:
            meta = {"epoch": next_epoch, "step": self.step, "provenance": json.dumps(self.provenance)}
            self.kind.save_checkpoint(self.drafter, self.ckpt / "last.safetensors", meta, model_state)
            tmp = self.state_path.with_name(self.state_path.name + ".tmp")
            torch.save(
                {
                    "inputs": self.inputs,
                    "optimizer": opt_state,
                    "scheduler": self.sched.state_dict(),
                    "step": self.step,
                    "next_epoch": next_epoch,
                    "next_batch": next_batch,
                    "epoch_sums": sums,
                    "train_config": json.dumps(self.tc_fields),
                    "history": json.dumps(self.history),
                    "best": json.dumps(self.best),
                    "rng": _rng_state(),
                },
                tmp,
            )
            os.replace(tmp, self.state_path)
        world.barrier()

    def train_epoch(self, epoch: int) -> list:
        """One epoch's optimizer steps (from the resumed batch); returns this process's running sums
        ``[loss·n, acc0·n, n, tokens]``."""
        tc, world, train = self.tc, self.world, self.train
        self.drafter.train()
        batches = _epoch_batches(train, tc, epoch)[: self.epoch_steps[epoch]]
        first = self.start_batch if epoch == self.start_epoch else 0
        sums = self.acc_state if (epoch == self.start_epoch and self.acc_state) else [0.0, 0.0, 0, 0]
        if self.feeder is not None:  # the servers fetch ahead, in the order the steps read
            self.feeder.schedule(
                [(sample_key(train[i].ids), train[i].ids) for b in batches[first:] for i in _flat(b)]
            )
        with progress(disable=not world.main) as bar:
            task = bar.add_task(
                f"train epoch {epoch + 1}/{tc.epochs}", total=len(batches), completed=first, tokens=0, note=""
            )
            for j in range(first, len(batches)):
                loss, st = self._step(epoch, batches[j])
                if st["n"][0]:  # a batch with no supervised token adds nothing (no fake 0 in the mean)
                    sums = [
                        sums[0] + float(loss.detach()) * st["n"][0],
                        sums[1] + st["acc"][0] * st["n"][0],
                        sums[2] + st["n"][0],
                        sums[3],
                    ]
                sums[3] += st["tokens"]
                bar.update(
                    task,
                    advance=1,
                    tokens=sums[3],
                    note=f"batch: loss {float(loss.detach()):.2f} acc0 {st['acc'][0]:.2f}",
                )
                if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 and j + 1 < len(batches):
                    self.logger.flush()
                    self.save(epoch, j + 1, sums)
                if self.stop_after and self.steps_run >= self.stop_after:
                    self.logger.close()
                    raise SystemExit(
                        f"train: stopped after {self.steps_run} steps (EAGLE3KIT_STOP_AFTER_STEPS)"
                    )
        return sums

    def _step(self, epoch: int, b) -> tuple:
        """One batch: features when not cached, the optimizer step, the schedule, the log record."""
        tc, train = self.tc, self.train
        t_step = time.perf_counter()
        idx = _flat(b)
        keys = None
        if self.feeder is not None:
            keys = self._fetch([train[i] for i in idx])
        elif not self.cached:
            compute_features(
                self.target,
                [train[i] for i in idx],
                self.aux_ids,
                tc.tokens_per_step,
                self.device,
                self.device,
                lse=tc.loss != "kl",
            )
        seed = (tc.seed * 1_000_003 + self.step) * 1024 + self.world.rank  # the same on a resume
        loss, st = self.kind.step(
            self.model,
            self.opt,
            self.target,
            train,
            b,
            self.speed,
            self.cfg,
            self.world,
            self.draft_ids,
            seed,
        )
        self.sched.step()
        self.step += 1
        self.steps_run += 1
        if not torch.isfinite(loss.detach()):
            raise DataError(
                f"train: the loss is {float(loss.detach())} at step {self.step} (epoch {epoch + 1}); nothing "
                "after the last checkpoint is kept. Lower train.lr, or check the features "
                "(`eagle3kit extract` refuses non-finite ones) and target.dtype"
            )
        self.trained_tokens += st["tokens"]
        if not self.cached:
            for i in idx:
                train[i].aux = train[i].last = train[i].argmax = None
        rec = {
            "step": self.step,
            "epoch": epoch + 1,
            "loss": round(float(loss.detach()), 5),
            "lr": self.sched.get_last_lr()[0],
            "acc": [round(a, 4) for a in st["acc"]],
            "n": st["n"],
            "implied_tau": round(implied_tau(st["acc"]), 4),
            "tokens": st["tokens"],
        }
        if self.feeder is not None:  # which samples, by their token ids' hash (resume and kill checks)
            rec["samples"] = keys
            rec["online_wait_s"] = round(self.feeder.wait_s, 3)
            # every process's own samples (rank 0's log holds only its own): the union is the epoch
            with open(self.consumed_path, "a") as fh:
                fh.write(
                    json.dumps({"step": self.step, "epoch": epoch + 1, "samples": rec["samples"]}) + "\n"
                )
        if "alpha" in st:  # the LK objectives: mean expected acceptance α per TTT step
            rec["alpha"] = [round(a, 4) for a in st["alpha"]]
        rec.update(st.get("log", {}))
        if self.steps_run > WARM_STEPS:  # the log record's float() has waited for the step's kernels
            self.steady[0] += st["tokens"]
            self.steady[1] += time.perf_counter() - t_step
        self.logger.step(rec, self.trained_tokens / max(self.timer.seconds, 1e-9))
        self.last_stats = rec
        return loss, st

    def validate(self, epoch: int, sums: list) -> None:
        """The epoch's record (train loss, step-0 accuracy, validation τ), the best checkpoint by
        rank 0's score, and ``last.*`` for resume."""
        world, cfg = self.world, self.cfg
        ep_loss, ep_acc0, ep_n, _ = world.sum_floats(sums)
        if ep_n == 0:
            raise DataError(
                f"train: epoch {epoch + 1} supervised no position: the target's top-1 is never in the draft "
                f"vocabulary ({self.vocab_path}) at a completion token. The vocabulary or the tokens were "
                "built from another target's outputs; rerun `eagle3kit generate`, `tokenize` and `vocab` for "
                "this target (a new run_dir)"
            )
        t_val = time.perf_counter()
        val_stats = self._simulate_val() if self.val else None
        self.seconds["validation"] += time.perf_counter() - t_val
        acc0 = f"train_{self.kind.first_accuracy}"
        epoch_rec = {
            "epoch": epoch + 1,
            "train_loss": round(ep_loss / max(ep_n, 1), 5),
            acc0: round(ep_acc0 / max(ep_n, 1), 4),
            "val_tau": round(val_stats.tau, 4) if val_stats else None,
        }
        self.history.append(epoch_rec)
        self.logger.epoch(epoch_rec, self.step)
        if world.main:
            console.print(
                f"epoch {epoch + 1}: loss {epoch_rec['train_loss']:.4f}  "
                f"{self.kind.first_accuracy.replace('_accuracy', '')} acc {epoch_rec[acc0]:.3f}"
                + (f"  val τ(K={cfg.evaluate.k}) {val_stats.tau:.3f}" if val_stats else "")
            )
        score = val_stats.tau if val_stats else -epoch_rec["train_loss"]
        score = world.sum_floats([score if world.main else 0.0])[0]  # rank 0's verdict, on every process
        if score > self.best["val_tau"]:
            self.best = {"val_tau": score, "epoch": epoch + 1}
            model_state, _ = full_state(self.drafter)
            if world.main:
                self.kind.save_checkpoint(
                    self.drafter,
                    self.ckpt / "best.safetensors",
                    {"epoch": epoch + 1, "provenance": json.dumps(self.provenance)},
                    model_state,
                )
        self.save(epoch + 1, 0, None)

    def _simulate_val(self) -> AcceptanceStats:
        """Simulated τ on the validation split; when its states are kept nowhere
        (``memory.val == "off"``), the target computes them again, a few steps' tokens at a time."""
        k = self.cfg.evaluate.k
        if self.memory.val != "off":
            return self.kind.validate(self.drafter, self.target, self.val, k, self.device)
        stats, group, size = AcceptanceStats(k), [], 0
        self.drafter.eval()
        for i, s in enumerate(self.val):
            group.append(s)
            size += s.ids.numel()
            if size < 4 * self.tc.tokens_per_step and i + 1 < len(self.val):
                continue
            compute_features(
                self.target,
                group,
                self.aux_ids,
                self.tc.tokens_per_step,
                self.device,
                self.device,
                label="validation states",
            )
            stats.merge(self.kind.validate(self.drafter, self.target, group, k, self.device))
            for g in group:
                g.aux = g.last = g.argmax = g.lse = None
            group, size = [], 0
        return stats

    def write(self) -> dict:
        """The report section (``report.json`` ``train``), the lineage of best.safetensors and the
        manifest's aux layer ids (rank 0); returns the section."""
        tc, world = self.tc, self.world
        self.logger.close()
        final = self.history[-1] if self.history else {}
        result = {
            "final_loss": final.get("train_loss"),
            self.kind.first_accuracy: final.get(f"train_{self.kind.first_accuracy}"),
            "best_epoch": self.best["epoch"],
            "best_val_tau": round(self.best["val_tau"], 4) if self.n_val else None,
            "epochs": tc.epochs,
            **self.kind.report(self.cfg, self.drafter),
            "train_samples": len(self.samples) - self.n_val,
            "val_samples": self.n_val,
            "history": self.history,
            "last_step": self.last_stats,
            "processes": world.size,
            "parallel": parallel_mode(self.model),
            "attention": self.speed["attention"],
            "precision": "bf16" if self.speed["bf16"] else ("tf32" if self.speed["tf32"] else "fp32"),
            "loss_chunk": self.speed["loss_chunk"],
            "compile": self.speed["compile"],
            "memory": self.memory.as_dict(),
            "seconds": {k: round(v, 1) for k, v in self.seconds.items()}
            | {"stage": round(self.timer.seconds, 1)},
        }
        if self.device.type == "cuda":  # what torch's allocator held at most (the plan's peak estimates it)
            result["memory"]["measured_peak"] = torch.cuda.max_memory_allocated(self.device)
        if self.init:
            result.update({k: self.init[k] for k in ("init_from", "lm_head_rows_copied")})
        if self.feeder is not None:
            result["online"] = {
                "servers": list(tc.online_from),
                "target_loaded": self.target.source.get("loaded", "whole"),
                **self.feeder.close(),
            }
        if self.trained_tokens:
            # wall: every token over the stage's clock (features, compilation, validation and
            # checkpoints included); steady: the optimizer steps after the run's first WARM_STEPS
            result["tokens_per_s"] = result["tokens_per_s_wall"] = round(
                self.trained_tokens / self.timer.seconds, 1
            )
            if self.steady[1] > 0:
                result["tokens_per_s_steady"] = round(self.steady[0] / self.steady[1], 1)
        if world.main:
            best_sha = sha256_tensors(self.ckpt / "best.safetensors")
            self.run.record_stage(
                "train",
                self.inputs,
                result,
                {"checkpoints/best.safetensors": best_sha},
                consumed=self.consumed,
                target=self.target.source.get("weights_fingerprint"),
            )
            self.run.update_manifest(
                aux_layer_ids={"convention": "hf_output_hidden_states_index", "ids": list(self.aux_ids)}
            )
        world.barrier()
        return result
