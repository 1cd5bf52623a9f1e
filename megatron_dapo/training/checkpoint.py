"""Training checkpoints: megatron-core ``dist_checkpointing`` for model + optimizer, plus the trainer's own state.

A checkpoint is one directory ``<save_dir>/global_step_<n>``::

    dist_ckpt/            model chunks (``model0``, ``model1``, ... = virtual pipeline stages) and optimizer state,
                          saved by every rank in parallel (torch_dist format; resharded on load)
    rng/rank_<r>.pt       every rank's generators (python, numpy, torch, megatron's tensor-parallel tracker)
    trainer_state.json    step, data position, lr-scheduler state, the parallel layout it was saved with
    config.yaml           the resolved experiment config

Atomicity: everything is written into ``<save_dir>/.tmp-step_<n>``, which is renamed to ``global_step_<n>`` only
after every rank finished; the ``latest`` marker (``global_step_<n>``) is replaced last (write + ``os.replace``).
A crash at any point leaves the previous checkpoint and ``latest`` untouched; a stale ``.tmp-*`` directory is
ignored and removed by the next save. Assumes a file system shared by all ranks (as Megatron-LM does).

Layout changes on load: model weights are resharded by ``dist_checkpointing`` for any TP/PP/DP change. The
non-distributed optimizer's state is keyed like the parameters, so it reshards the same way. The distributed
optimizer is saved in megatron-core's ``dp_reshardable`` format: a different DP size loads, a different TP/PP does
not (megatron-core's ``fully_reshardable`` format would allow it but fails with torch's Adam, which keeps a
per-parameter ``step`` tensor — the case on CPU and on GPUs without TransformerEngine/Apex). RNG states are
restored only when the layout (world size, TP, PP, VPP) is unchanged; otherwise the seeded generators are kept and
``rng_restored`` is False. The padded vocabulary grows with TP (``make_vocab_size_divisible_by`` × TP): the saved
embedding/output rows load and the extra padding rows keep their initial values (megatron-core's
``allow_shape_mismatch``). A change of the virtual pipeline size is not supported.

With torch's Adam (no TransformerEngine/Apex) megatron-core's DistributedOptimizer neither restores Adam's ``step``
nor keeps it per parameter on load; ``_restore_torch_adam_steps`` sets it from ``trainer_state.json``.

Note: megatron-core's checkpoint writer starts a helper with the ``spawn`` method on the first save, which
re-imports the launching script: scripts run under torchrun must keep their work under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

log = logging.getLogger("megatron_dapo.checkpoint")

FORMAT_VERSION = 1
STEP_PREFIX = "global_step_"
TMP_PREFIX = ".tmp-step_"
LATEST = "latest"
DIST_DIR = "dist_ckpt"
RNG_DIR = "rng"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
DIST_OPTIM_FORMAT = "dp_reshardable"
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model/optimizer it is loaded into."""


# --------------------------------------------------------------------------------------------------- helpers


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    # Make a rename durable: the directory entry itself must reach the disk.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _layout() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "world_size": _world(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def _uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in inner)


def _torch_adams(optimizer) -> list:
    """Per chained optimizer: its torch ``Adam``/``AdamW`` when it is a ``DistributedOptimizer`` over one, else None.

    Without TransformerEngine/Apex (always on CPU) megatron-core runs torch's Adam, which keeps a per-parameter
    ``step`` tensor in its state. megatron-core 0.16's DistributedOptimizer mishandles that ``step``:
      * building its state dict asserts on a never-stepped optimizer (no ``step`` yet) — ``_prime_torch_adams``;
      * loading leaves ``step`` at its pre-load value and makes one tensor shared by all parameters, which torch
        then increments once per parameter per step — ``_restore_torch_adam_steps`` (from ``trainer_state.json``).
    """
    from megatron.core.optimizer import DistributedOptimizer

    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        out.append(inner if isinstance(opt, DistributedOptimizer) and isinstance(inner, torch.optim.Adam) else None)
    return out


def _torch_adam_steps(optimizer) -> list[Optional[float]]:
    steps = []
    for inner in _torch_adams(optimizer):
        values = {float(st["step"]) for st in inner.state.values() if "step" in st} if inner is not None else set()
        # All parameters step together (megatron gives every main parameter a gradient); max() guards the record.
        steps.append(max(values) if values else None)
    return steps


def _prime_torch_adams(optimizer) -> None:
    """Give never-stepped parameters the state torch's Adam would create on its first step (zeros, step 0)."""
    for inner in _torch_adams(optimizer):
        for group in inner.param_groups if inner is not None else []:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)


def _restore_torch_adam_steps(optimizer, steps: list[Optional[float]]) -> None:
    for inner, step in zip(_torch_adams(optimizer), steps):
        if inner is None or step is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                # One tensor per parameter: torch's Adam increments each parameter's step in place.
                inner.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32)


def _sharded_state_dict(model_chunks: list, optimizer, is_loading: bool) -> dict:
    """Megatron-LM's layout: ``model<i>`` per chunk (unwrapped GPTModel) and ``optimizer``."""
    from megatron_dapo.models.builder import unwrap

    state: dict[str, Any] = {}
    for i, chunk in enumerate(model_chunks):
        state[f"model{i}"] = unwrap(chunk).sharded_state_dict()
    if optimizer is not None:
        metadata = {"distrib_optim_sharding_type": DIST_OPTIM_FORMAT} if _uses_distributed_optimizer(optimizer) else {}
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    return state


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def missing_parts(step_dir: Union[str, Path]) -> list[str]:
    """What a complete checkpoint directory has and ``step_dir`` lacks (empty list = complete)."""
    step_dir = Path(step_dir)
    missing = [
        part
        for part in (STATE_FILE, f"{DIST_DIR}/metadata.json", f"{DIST_DIR}/.metadata", RNG_DIR)
        if not (step_dir / part).exists()
    ]
    if STATE_FILE not in missing:
        try:
            state = json.loads((step_dir / STATE_FILE).read_text())
            world = int(state["layout"]["world_size"])
        except (ValueError, KeyError, TypeError):
            return missing + [f"{STATE_FILE} (unreadable)"]
        if RNG_DIR not in missing:
            missing += [
                f"{RNG_DIR}/{_rng_name(r)}" for r in range(world) if not (step_dir / RNG_DIR / _rng_name(r)).exists()
            ]
    return missing


def _rng_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def complete_checkpoints(save_dir: Union[str, Path]) -> list[tuple[int, Path]]:
    """(step, path) of the complete ``global_step_<n>`` directories under ``save_dir``, by step."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = []
    for child in save_dir.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and not missing_parts(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def resolve_resume(resume_mode: str, save_dir: Optional[Union[str, Path]]) -> Optional[Path]:
    """Which checkpoint to resume from.

    ``disable`` → None; ``auto`` → the step directory named by ``<save_dir>/latest`` (or, without a marker, the
    highest complete step directory), None when there is none; anything else is a path to a step directory, which
    must exist and be complete.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        if save_dir is None or not Path(save_dir).is_dir():
            return None
        save_dir = Path(save_dir)
        marker = save_dir / LATEST
        if marker.is_file():
            name = marker.read_text().strip()
            target = save_dir / name
            missing = missing_parts(target) if target.is_dir() else ["the directory itself"]
            if missing:
                raise CheckpointError(
                    f"checkpoint.resume_mode=auto: {marker} names {name!r} but {target} is incomplete (missing: "
                    f"{', '.join(missing)}); pass checkpoint.resume_mode=<step dir> or disable"
                )
            return target
        found = complete_checkpoints(save_dir)
        return found[-1][1] if found else None
    path = Path(resume_mode)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint.resume_mode={resume_mode!r}: no such checkpoint directory (expected auto, disable or a "
            f"{STEP_PREFIX}<n> directory)"
        )
    missing = missing_parts(path)
    if missing:
        hint = ""
        if (path / LATEST).is_file():
            hint = f"; it looks like a save_dir (it has a '{LATEST}' marker): pass a {STEP_PREFIX}<n> directory in it"
        raise CheckpointError(
            f"checkpoint.resume_mode={resume_mode!r}: {path} is not a complete checkpoint (missing: "
            f"{', '.join(missing)}){hint}"
        )
    return path


# --------------------------------------------------------------------------------------------------- manager


class CheckpointManager:
    """Save/load training checkpoints under ``save_dir``; keep at most ``max_ckpt_to_keep`` (None/<=0: all)."""

    def __init__(self, save_dir: Union[str, Path], max_ckpt_to_keep: Optional[int] = None) -> None:
        self.save_dir = Path(save_dir)
        self.max_ckpt_to_keep = max_ckpt_to_keep

    def save(
        self,
        step: int,
        model_chunks: list,
        optimizer=None,
        scheduler=None,
        data_state: Optional[dict] = None,
        config: Optional[dict] = None,
        save_optimizer: bool = True,
    ) -> Path:
        """Collective (every rank calls it). Returns the final step directory."""
        from megatron.core import dist_checkpointing

        from megatron_dapo.platform import get_platform

        started = time.perf_counter()
        rank = _rank()
        tmp = self.save_dir / f"{TMP_PREFIX}{step}"
        final = self.save_dir / step_dir_name(step)
        # The generators as they are when the caller asks for the save (nothing below should draw, but be exact).
        rng = {"rank": rank, "layout": _layout(), "state": get_platform().rng_state()}
        if optimizer is not None and save_optimizer:
            _prime_torch_adams(optimizer)
        # Fail before any rank writes anything if the rank-0-only payload cannot be serialised.
        state_text = json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "step": int(step),
                "data_state": data_state,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "has_optimizer": bool(save_optimizer and optimizer is not None),
                "distributed_optimizer": optimizer is not None and _uses_distributed_optimizer(optimizer),
                "torch_adam_steps": _torch_adam_steps(optimizer) if optimizer is not None else [],
                "num_model_chunks": len(model_chunks),
                "layout": _layout(),
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
            indent=2,
        )
        if rank == 0:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.save_dir.glob(".tmp-*"):  # left by a crashed save or deletion
                if stale.is_dir():
                    shutil.rmtree(stale)
            (tmp / DIST_DIR).mkdir(parents=True)
            (tmp / RNG_DIR).mkdir()
        _barrier()

        sharded = _sharded_state_dict(model_chunks, optimizer if save_optimizer else None, is_loading=False)
        dist_checkpointing.save(sharded, str(tmp / DIST_DIR))
        torch.save(rng, tmp / RNG_DIR / _rng_name(rank))
        if rank == 0:
            (tmp / STATE_FILE).write_text(state_text)
            if config is not None:
                import yaml

                (tmp / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
        _barrier()  # every rank's files are in place

        if rank == 0:
            self._commit(tmp, final)
            self._rotate(keep=final)
        _barrier()
        if rank == 0:
            log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - started)
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        _fsync_dir(tmp)
        old = None
        if final.exists():  # re-saving a step (e.g. after resuming from it): swap, then delete the old copy
            old = final.with_name(f".tmp-replaced-{final.name}")
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.save_dir)
        _write_atomic(self.save_dir / LATEST, final.name + "\n")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _rotate(self, keep: Path) -> None:
        if not self.max_ckpt_to_keep or self.max_ckpt_to_keep <= 0:
            return
        others = [(s, p) for s, p in complete_checkpoints(self.save_dir) if p != keep]
        excess = len(others) + 1 - self.max_ckpt_to_keep
        for _, path in others[: max(excess, 0)]:  # lowest steps first
            doomed = path.with_name(f".tmp-delete-{path.name}")
            os.rename(path, doomed)  # no half-deleted global_step_<n> is ever visible
            shutil.rmtree(doomed, ignore_errors=True)

    def load(
        self,
        step_dir: Union[str, Path],
        model_chunks: list,
        optimizer=None,
        scheduler=None,
        load_optimizer: bool = True,
        load_rng: bool = True,
    ) -> dict[str, Any]:
        """Collective. Restores model chunks, optimizer (when saved and requested), scheduler and RNG in place.

        Returns ``{"step", "data_state", "config", "path", "optimizer_restored", "rng_restored"}``.
        """
        from megatron.core import dist_checkpointing

        from megatron_dapo.models.builder import unwrap
        from megatron_dapo.platform import get_platform

        step_dir = Path(step_dir)
        missing = missing_parts(step_dir) if step_dir.is_dir() else ["the directory itself"]
        if missing:
            raise CheckpointError(f"cannot load checkpoint {step_dir}: incomplete (missing: {', '.join(missing)})")
        state = json.loads((step_dir / STATE_FILE).read_text())
        if state.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{step_dir / STATE_FILE}: format_version {state.get('format_version')!r}, expected {FORMAT_VERSION}"
            )
        if state["num_model_chunks"] != len(model_chunks):
            raise CheckpointError(
                f"{step_dir} holds {state['num_model_chunks']} model chunk(s) per rank (virtual pipeline stages) but "
                f"{len(model_chunks)} were given; loading across a virtual-pipeline change is not supported"
            )
        saved_layout, layout = state["layout"], _layout()
        restore_optimizer = bool(load_optimizer and optimizer is not None and state["has_optimizer"])
        if restore_optimizer and state["distributed_optimizer"] and _uses_distributed_optimizer(optimizer):
            sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
            changed = [k for k in sizes if saved_layout[k] != layout[k]]
            if changed:
                raise CheckpointError(
                    f"{step_dir}: the distributed optimizer's state ({DIST_OPTIM_FORMAT}) reshards only across data "
                    f"parallelism, but {', '.join(f'{k} {saved_layout[k]} -> {layout[k]}' for k in changed)}; "
                    "resume with the saved TP/PP or load weights only (load_optimizer=False)"
                )
        if restore_optimizer and state["distributed_optimizer"] != _uses_distributed_optimizer(optimizer):
            raise CheckpointError(
                f"{step_dir}: saved with use_distributed_optimizer={state['distributed_optimizer']} but this run has "
                f"{not state['distributed_optimizer']}; the optimizer state formats differ (load_optimizer=False "
                "loads the weights only)"
            )

        if restore_optimizer:
            _prime_torch_adams(optimizer)
        sharded = _sharded_state_dict(model_chunks, optimizer if restore_optimizer else None, is_loading=True)
        loaded = dist_checkpointing.load(sharded, str(step_dir / DIST_DIR))
        for i, chunk in enumerate(model_chunks):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
        if restore_optimizer:
            # megatron-core copies into views of leaf parameters (fp32 + distributed optimizer): needs no_grad.
            with torch.no_grad():
                optimizer.load_state_dict(loaded["optimizer"])
            _restore_torch_adam_steps(optimizer, state["torch_adam_steps"])
        elif optimizer is not None:
            # Main (fp32) params were copied from the model when the optimizer was built: refresh them.
            optimizer.reload_model_params()
            if _rank() == 0:
                log.warning("checkpoint %s: optimizer state not restored (saved: %s)", step_dir, state["has_optimizer"])

        if scheduler is not None and state.get("scheduler") is not None:
            # megatron-core's load_state_dict *adds* the saved step count to the current one.
            scheduler.num_steps = 0
            scheduler.load_state_dict(state["scheduler"])

        rng_restored = False
        if load_rng:
            if saved_layout == layout:
                payload = torch.load(step_dir / RNG_DIR / _rng_name(_rank()), weights_only=False)
                get_platform().set_rng_state(payload["state"])
                rng_restored = True
            elif _rank() == 0:
                log.warning(
                    "checkpoint %s: RNG states not restored, parallel layout changed %s -> %s",
                    step_dir,
                    saved_layout,
                    layout,
                )
        config = None
        if (step_dir / CONFIG_FILE).is_file():
            import yaml

            config = yaml.safe_load((step_dir / CONFIG_FILE).read_text())
        _barrier()
        return {
            "step": int(state["step"]),
            "data_state": state["data_state"],
            "config": config,
            "path": step_dir,
            "optimizer_restored": restore_optimizer,
            "rng_restored": rng_restored,
        }
