"""The engine's durable state: the first import, resume from the newest intact commit, and the
commit itself (files durable, then the manifest), deferred by one forward (`settle`).

`Engine` takes these methods from `DurableState`; they use its store, optimizer, state and root.
"""
from __future__ import annotations

import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from ..faults import fault
from ..storage import CorruptionError, StorageError
from ..storage.packed import pack_name
from ..storage import commit as C
from ..storage.layout import key
from .expert_state import ExpertShards, committed_slot, has_moments

_MANAGED = ("act", "w0", "w1", "master0", "master1", "m0", "m1", "v0", "v1", "grad", "gacc", "packs", "checkpoints")


class DurableState:
    def _fingerprint(self) -> dict:
        return {"model_type": self.config.model_type, "precision": self.cfg.precision,
                "shard_elems": self.shard_elems,
                # only when not fp32: states committed before the option existed still resume
                **({"optim_states": self.cfg.optim_states} if self.cfg.optim_states != "fp32" else {}),
                "params": {n: list(i.shape) for n, i in self.infos.items()},
                # only with stacked experts, cut by expert: states committed before stay dense-cut
                **({"expert_shards": experts} if (experts := {n: i.experts for n, i in self.infos.items()
                                                              if i.experts}) else {}),
                # only where a bf16 run keeps working weights in fp32 (their files are fp32)
                **({"fp32_weights": sorted(self.kept32)} if self.kept32 else {})}

    def _load_or_import(self, source, resume: bool, overwrite: bool) -> dict:
        if self.dist is not None:
            candidates = self.dist_candidates  # the step every rank committed (tierlm.dist.state)
        else:
            candidates = C.list_manifests(self.root) + C.list_checkpoints(self.root)
        if resume and candidates:
            return self._resume(candidates)
        if candidates and not overwrite:
            step = C.read_manifest(candidates[0]).get("step", "?")
            raise ValueError(f"{self.root} holds the committed state of a run at step {step}; "
                             f"continue it with --resume auto, or start over with --overwrite "
                             f"(which deletes it), or choose another --nvme directory")
        for d in _MANAGED:
            shutil.rmtree(self.root / d, ignore_errors=True)
        for m in C.list_manifests(self.root):
            m.unlink()
        state = {"format": 1, "fingerprint": self._fingerprint(), "step": 0,
                 "optim": {"slots": {n: 0 for n in self.infos}, "steps": {n: 0 for n in self.infos}}}
        if self.dist is None and self.cfg.optim.weight_decay == 0:
            # experts no token reaches keep their state untouched (expert_state.py)
            state["optim"].update(ExpertShards.initial(self.infos))
        if self.dist is not None:
            state["dist"] = self.dist.describe()
        for name, info in self.infos.items():
            master = torch.empty(info.shape, dtype=torch.float32)
            source(name, master)
            flat = master.reshape(-1)
            futs = []
            for k, (a, b) in enumerate(info.shards):
                if self._owned(name):
                    futs.append(self.store.write(key("master", name, k, 0), flat[a:b]))
                if self._wkind(name) == "w":
                    futs.append(self.store.write(key("w", name, k, 0), flat[a:b].to(self.wdtype(name))))
            for f in futs:
                f.result()
            del master, flat
        self.state = state
        self._write_manifest()
        return state

    def _resume(self, candidates) -> dict:
        """The newest committed state whose every file is intact; older ones, then checkpoints,
        are the fallbacks (each passed-over state is reported with the reason)."""
        live = set(C.list_manifests(self.root))
        for m in candidates:
            try:
                content = C.read_manifest(m)
                if content.get("fingerprint") != self._fingerprint():
                    raise ValueError(f"{m}: the state there belongs to another model, precision, shard "
                                     f"size or optimizer-state format ({_fingerprint_diff(content.get('fingerprint') or {}, self._fingerprint())}); "
                                     f"point --nvme at a new directory or start over with --overwrite")
                if m not in live:
                    C.restore_files(self.root, m)
                self.store.load_manifest(content["records"])
                C.verify(self.store, content["records"])
            except (CorruptionError, StorageError) as e:
                self.fallbacks.append(f"{m.name if m in live else m}: {e}")
                continue
            state = {k: v for k, v in content.items() if k != "records"}
            if m not in live:
                self.state = state
                self._write_manifest()  # the restored checkpoint becomes the current state
            return state
        raise CorruptionError(f"{self.root}: no intact committed state to resume from:\n  "
                              + "\n  ".join(self.fallbacks))

    def _current_keys(self, state: dict | None = None) -> list[str]:
        state = state or self.state
        optim = state["optim"]
        keys = []
        for n, info in self.infos.items():
            shards = range(len(info.shards))
            kinds = (["master", "m", "v"] if optim["steps"][n] > 0 else ["master"]) if self._owned(n) else []
            kinds += ["w"] if self._wkind(n) == "w" else []
            # (a fresh expert shard has no moments yet, and its own slot: expert_state.py)
            keys += [key(kind, n, k, committed_slot(optim, n, k)) for kind in kinds for k in shards
                     if kind not in ("m", "v") or has_moments(optim, n, k)]
        return keys

    def _write_manifest(self, state: dict | None = None) -> None:
        """Commit: make the step's files and renames durable, then the manifest; the manifest
        before the previous one goes last."""
        state = state or self.state
        # the small tensors first, into this step's pack
        packed = self.store.pack(pack_name(state["step"]), self._current_keys(state))
        current = {k: r.to_json() for k, r in packed.items()}
        fault("commit.fsync")
        C.sync_fs(self.root)
        if self.dist is not None:
            self.dist.agree(what="commit")  # every rank's files are durable: the step may commit
        C.write_manifest(self.root, dict(state, records=current))
        if self.dist is not None:
            # No rank may overwrite the fallback's files (the next step's writes) before every
            # rank's manifest is durable: a crash between leaves all ranks one common state.
            self.dist.agree(what="commit")
        C.prune(self.root)

    @staticmethod
    def _land(tail: list[Future]) -> None:
        for f in tail:
            f.result()  # a failed write raises here, naming its file: the step does not commit

    def _land_and_commit(self, tail: list[Future], state: dict) -> None:
        self._land(tail)
        t0 = time.perf_counter()
        self._write_manifest(state)
        self.commits.manifest_s.append(time.perf_counter() - t0)

    def flush(self) -> None:
        """Make the newest state the committed one now (between steps): what the steps since the
        last commit kept in RAM is written, synced, and named by a manifest."""
        self.settle()
        if not (self.optimizer.dirty or self.optimizer.cache.unwritten):
            return
        self._land(self.optimizer.make_durable())
        self._write_manifest()
        self.commits.steps_since = 0

    def settle(self) -> None:
        """Wait until the last committed step is durable (its writes, syncfs, manifest); raises
        what stopped it. Done before anything that writes state or needs it on disk."""
        fut, self._commit_fut = self._commit_fut, None
        if fut is not None:
            t0 = time.perf_counter()
            with self.timeline.span("wait", "previous commit"):
                fut.result()
            self.acts.waited(time.perf_counter() - t0)

    def checkpoint(self, name: str) -> Path:
        """A named snapshot of the newest state, committed first (hard links: no bytes copied)."""
        self.flush()
        return C.snapshot(self.root, C.list_manifests(self.root)[0], name)



def _fingerprint_diff(old: dict, new: dict) -> str:
    diffs = [f"{k}: {old.get(k)!r} there, {new.get(k)!r} here" for k in sorted(set(old) | set(new))
             if k not in ("params", "fp32_weights") and old.get(k) != new.get(k)]
    if old.get("fp32_weights") != new.get("fp32_weights"):
        diffs.append(f"working weights kept in fp32: {len(old.get('fp32_weights') or [])} there (an earlier "
                     f"tierlm trained a mixture's router weights in bf16), {len(new.get('fp32_weights') or [])} here")
    if old.get("params") != new.get("params"):
        diffs.append("parameter shapes differ")
    return "; ".join(diffs)
