"""The inputs of a ``train`` run, resolved once: the world, the target, the draft vocabulary, the aux ids,
the samples and their split, the memory plan, stored features or the capture servers, and what a resume
must share (:class:`_Inputs`, the base of :class:`eagle3kit.train.stage._Training`)."""

from __future__ import annotations

import importlib.util
import random

import torch

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.kinds import DrafterKind
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.rundir import (
    RunDir,
    open_safetensors,
    sha256_json,
)
from eagle3kit.core.ui import console
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
from eagle3kit.train.batches import Sample, epoch_batches, flat_indices
from eagle3kit.train.distributed import init_world
from eagle3kit.train.extract import engine_features, feature_inputs
from eagle3kit.train.features import load_features
from eagle3kit.train.memory import MemoryPlan, print_plan, training_plan
from eagle3kit.train.online import EngineFeeder, sample_key, server_version
from eagle3kit.train.optimizer_step import rank_micros, step_groups
from eagle3kit.train.samples import trained_settings
from eagle3kit.train.transport import bytes_per_token

ENGINE_CHECK = 16  # online: samples whose engine token is compared with this target's argmax


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


class _Inputs:
    """What a ``train`` run stands on, resolved in ``__init__`` (see :class:`eagle3kit.train.stage._Training`)."""

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
            self.mine,
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
        if n_val >= len(samples):
            raise ConfigError(
                f"train.val_fraction {tc.val_fraction} keeps all {len(samples)} samples with a supervised token "
                "for validation and leaves none to train on: lower it (0.05 keeps 1 in 20), or add prompts"
            )
        # FSDP: all validate
        self.val = [samples[i] for i in order[:n_val]] if world.main or tc.parallel == "fsdp" else []
        # every process forms every step's micro-batches from all of them, and runs its own
        self.train = [samples[i] for i in order[n_val:]]
        self.steps = [
            step_groups(epoch_batches(self.train, tc, e), tc.accumulate, world.size) for e in range(tc.epochs)
        ]
        mine = {i for steps in self.steps for g in steps for i in self._indices(g)}
        self.mine = [self.train[i] for i in sorted(mine)]  # the samples whose states this process needs

    def _indices(self, group: list) -> list[int]:
        """The samples this process runs of the step ``group`` (every micro-batch's)."""
        micros, _ = rank_micros(group, self.world.rank, self.tc.accumulate)
        return [i for m in micros for i in flat_indices(m)]


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
