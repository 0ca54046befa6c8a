"""Checkpoints with torch.distributed.checkpoint (DCP): save, find the newest complete one, load.

Layout under the checkpoint directory:

    step_00000100/            a complete checkpoint (DCP files + shardkit-checkpoint.json)
    step_00000200.partial/    a save in progress, or one a crash interrupted: never loaded

A save writes into `step_N.partial/`; once every rank's DCP files are written, rank 0 writes the
marker `shardkit-checkpoint.json` (the run's metadata and every file with its size) and renames the
directory to `step_N/` (one atomic rename on a POSIX filesystem). A crash at any moment before the
rename leaves the previous checkpoint as the newest complete one. A complete checkpoint damaged later
(a file truncated, deleted or half-copied) fails `checkpoint_problem` before DCP reads it, and
`--resume auto` falls back to the newest one that passes. Model and optimizer go through `get_state_dict`, whose fully-qualified names
do not depend on DDP or FSDP and whose FSDP tensors are DTensors, so DCP reshards on load: a
checkpoint resumes at another world size or parallel mode.

A tensor that the model holds under two names (tied embeddings: `lm_head.weight` is `tok_emb.weight`)
is saved once, under its first name, and loaded into both; pipeline stages that each hold a copy of it
save the same entry, which DCP keeps once.

The marker records the model's whole configuration (`model_record`); a resume builds the checkpoint's
model or refuses one whose architecture differs (`model_to_resume`).

Each rank's own state (RNG, loader position) is stored under a rank-specific key `rank_R`, since
DCP keeps one copy of keys that every rank saves. Non-tensor values are JSON strings, and loading
uses `torch.load(weights_only=True)`; DCP's own index `.metadata` (a pickle) is read by a restricted
unpickler (`checkpoint_metadata`), so a checkpoint can never run code.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from shardkit.train import faults
from shardkit.train.config.checkpoint import ASYNC_WRITERS
from shardkit.train.checkpoint_background import AlreadyStaged, Publications, SaveThread, upload_of
from shardkit.train.checkpoint_metadata import SafeFileSystemReader
from shardkit.train.checkpoint_staging import FlatStager, flat_stageable
from shardkit.train.checkpoint_state import SaveStateDict, optimizer_settings
from shardkit.train.checkpoint_writer import ExpandingSavePlanner, WriterProcessFileSystemWriter

logger = logging.getLogger(__name__)

MARKER_NAME = "shardkit-checkpoint.json"
_STEP_NAME = re.compile(r"step_\d{8,}")
PARTIAL_SUFFIX = ".partial"
# Where DCP's writer process writes a save of nothing as it starts (see `Checkpointer._start_writer`).
WRITER_CHECK_NAME = ".writer-check"
# "dcp": background saves staged by DCP's own stager, not `FlatStager` (for comparison, or a state it mis-serves).
STAGING_VARIABLE = "SHARDKIT_CHECKPOINT_STAGING"
WRITER_START_VARIABLE = "SHARDKIT_CHECKPOINT_WRITER_START"
# Optimizer state and param groups keyed by parameter name: pipeline stages hold different
# parameters, and a per-group list of names saved by every stage would collide in DCP.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor values are unpickled with `weights_only=True`."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _complete(directory: Path) -> list[Path]:
    """Complete checkpoints (those with a marker) in `directory`, newest first."""
    if not directory.is_dir():
        return []
    complete = [p for p in directory.iterdir() if _STEP_NAME.fullmatch(p.name) and (p / MARKER_NAME).is_file()]
    return sorted(complete, key=lambda p: int(p.name[len("step_"):]), reverse=True)


def find_latest(directory: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `directory`, or None."""
    return next(iter(_complete(Path(directory))), None)


def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `directory`, newest first."""
    return [(int(p.name[len("step_"):]), p) for p in _complete(Path(directory))]


def read_rank_state(path: str | Path, rank: int = 0) -> dict[str, Any]:
    """One rank's saved state (its RNG and loader position) alone: no process group, model or optimizer. What
    `shardkit trace` reads of a raw-text run's checkpoints (the loader's lane cursors).

    Raises:
        ValueError: the checkpoint is damaged or holds no state of that rank.
    """
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} is damaged: {problem}")
    key = f"rank_{rank}"
    state = {key: ""}
    try:
        with warnings.catch_warnings():  # DCP says it assumes one process without a process group: it is one
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeFileSystemReader(path),
                     planner=SafeLoadPlanner())
        return json.loads(state[key])
    except (CheckpointException, EOFError, OSError, RuntimeError, ValueError, KeyError) as err:
        raise ValueError(f"checkpoint {path}: the state of rank {rank} cannot be read ({_first_failure(err)})") \
            from err


def read_marker(path: str | Path) -> dict[str, Any]:
    try:
        return _parse_marker(Path(path))
    except FileNotFoundError:
        raise ValueError(f"{path} is not a complete shardkit checkpoint ({MARKER_NAME} is missing: "
                         "the save was interrupted; use an older checkpoint or --resume auto)") from None
    except ValueError as err:
        raise ValueError(f"checkpoint {path}: {err}") from err


def _parse_marker(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / MARKER_NAME).read_text())
    except FileNotFoundError:
        raise
    except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{MARKER_NAME} is damaged ({type(err).__name__})") from err
    if not isinstance(meta, dict):
        raise ValueError(f"{MARKER_NAME} is damaged (not a JSON object)")
    return meta


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None when its files are the ones its marker
    lists, at the listed sizes (a truncated, deleted or half-copied file is caught before DCP reads it)."""
    path = Path(path)
    try:
        files = _parse_marker(path).get("files")
    except FileNotFoundError:
        return f"{MARKER_NAME} is missing"
    except ValueError as err:
        return str(err)
    escaped = _link_leaving(path)
    if escaped is not None:
        return escaped
    if files is None:
        return None  # saved before markers listed their files: nothing to check against
    if not isinstance(files, dict):
        return f"{MARKER_NAME} is damaged (its file list is not an object)"
    for name, size in sorted(files.items()):
        if "/" in name or name in ("", ".", "..") or not isinstance(size, int):
            return f"{MARKER_NAME} is damaged (file entry {name!r})"
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the marker says {size}"
    return None


def _link_leaving(path: Path) -> str | None:
    """The problem of a symbolic link in checkpoint `path` that resolves outside it, or None.

    DCP opens its storage files by name inside the directory, and a name is checked to stay there; a
    link would still take the read elsewhere (a file of another run, or of another user, loaded as
    weights). Links that stay inside are harmless; so is a checkpoint directory that is itself a link."""
    root = path.resolve()
    for entry in sorted(path.iterdir()):
        if entry.is_symlink() and not entry.resolve().is_relative_to(root):
            return (f"{entry.name} is a symbolic link to {os.readlink(entry)}, outside the checkpoint: refused "
                    "(a checkpoint's files must be inside its directory; copy the file in if it is yours)")
    return None


def find_resumable(directory: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint that passes `checkpoint_problem`, and the newer ones skipped
    with their problem. (None, [...]) when every checkpoint is damaged; (None, []) when there is none."""
    skipped = []
    for path in _complete(Path(directory)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `Checkpointer.load` restored besides model, optimizer and scheduler.

    Attributes:
        step: optimizer steps done when it was saved.
        rank_state: this rank's saved state, or rank 0's when `same_topology` is False.
        same_topology: whether it was saved at the current world size.
        meta: the marker's metadata (world size, parallel mode, model config, ...).
        extra: the `extra` state asked for, loaded (tensors in place, other values replaced).
    """

    step: int
    rank_state: dict[str, Any]
    same_topology: bool
    meta: dict[str, Any]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    """Saves and loads the training state of every rank.

    Args:
        directory: where the checkpoints go (shared by all ranks: a shared filesystem on multi-node runs).
        rank: this process's rank.
        keep: number of complete checkpoints to keep.
        async_save: copy the state to CPU memory (pinned on a GPU) and write it in the background
            (dcp.async_save), so that the loop pays only the copy; the checkpoint is published (marker,
            rename) when every rank has written its part, at a sync point of the loop or the next save. After
            the first save of a state of CPU parameters, a thread takes each save over once the loop has taken
            the loader's state (`checkpoint_background`).
        async_writer: what writes a background save: "process", DCP's writer process (started with the
            checkpointer, it plans and writes off the trainer's GIL and cores), or "thread", a thread of the
            trainer (it competes with the steps for the GIL). One process without a process group always
            writes in a thread: DCP's writer process joins a group of its own that mirrors the trainers'.
        aliases: model state names that hold the same tensor as another name ({alias: name}, see
            `shardkit.train.model.tied_weights`): saved once under the name.
    """

    def __init__(self, directory: str | Path, *, rank: int, keep: int = 3, async_save: bool = False,
                 async_writer: str = "process", aliases: dict[str, str] | None = None):
        self.directory = Path(directory)
        self.aliases = dict(aliases or {})
        self.rank = rank
        self.keep = keep
        self.async_save = async_save
        # (future, directory, meta) of the save being written; meta None: the writer process's start
        self._pending: tuple[Any, Path, dict[str, Any] | None] | None = None
        # "wait": a save while DCP's writer process starts waits for it (the behaviour before saving synchronously).
        self._sync_while_writer_starts = os.environ.get(WRITER_START_VARIABLE, "sync") != "wait"
        self._cleaned = False  # whether rank 0 removed the partial directories left before this run's first save
        self._async_group = None
        self._stager: DefaultStager | FlatStager | None = None
        self._publications = Publications()  # rank 0 marks written checkpoints complete in a thread
        self._save_thread: SaveThread | None = None  # takes background saves over after the first (see save)
        self.writer = _writer_type(async_writer) if async_save else None
        # A background save's state dicts, cheap after the first save; DCP's stager path keeps get_state_dict.
        self._flat_staging = os.environ.get(STAGING_VARIABLE, "flat") != "dcp"
        fast = async_save and self._flat_staging
        self._save_state_dict = SaveStateDict(STATE_DICT_OPTIONS) if fast else None
        if not dist.is_initialized():
            # DCP warns on every call (also from its background thread) without a process group;
            # one process is a supported case here, so that one message is silenced.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        if async_save and dist.is_initialized():
            # A separate gloo group: the background writer's collectives must not interleave with
            # the training's own collectives on the default group.
            self._async_group = dist.new_group(backend="gloo")
        if self.writer == AsyncCheckpointerType.PROCESS:
            self._start_writer()

    def _start_writer(self) -> None:
        """Start DCP's writer process now, in the background, with a save of nothing into a scratch directory:
        a new interpreter that imports torch and joins its group takes seconds, which the first real save would
        otherwise wait for (the model is built and the checkpoint loaded meanwhile). It also finds out early
        whether the writer can write into the checkpoint directory."""
        scratch = self.directory / WRITER_CHECK_NAME
        if self.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)  # left by a run that ended before its writer started
        _barrier()
        future = dcp.async_save({}, checkpoint_id=str(scratch), process_group=self._async_group,
                                storage_writer=WriterProcessFileSystemWriter(scratch),
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        self._pending = (future, scratch, None)

    def save(self, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             rank_state: dict[str, Any], meta: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        """Save the state after `step` optimizer steps (collective: every rank calls it).

        `extra` holds more top-level entries (e.g. DiLoCo's outer state); keys saved by every rank
        are kept once, so per-rank values need rank-specific keys."""
        # A writer process still starting (a restarted worker's first save comes seconds before its new writer
        # is ready) is not waited for: this one save is written synchronously. Every rank takes the same path:
        # the start is completed only where every rank reported it done (the loop's sync point) or by a save.
        writer_starting = self._pending is not None and self._pending[2] is None and self._sync_while_writer_starts
        in_thread = self.async_save and not writer_starting and self._save_thread is not None
        if not writer_starting:
            # Logs its own time. The stale partials are removed after the previous checkpoint's publication: by the
            # save thread (which waits for it), else here (join).
            self.wait(join=not in_thread)
        else:
            self._publications.join()
        started = time.perf_counter()
        final = self.directory / checkpoint_name(step)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        meta = {**meta, "step": step}
        # What changes before the next optimizer step without passing through it is taken now.
        texts = {"scheduler": json.dumps(scheduler.state_dict()), "train": json.dumps({"step": step}),
                 f"rank_{self.rank}": json.dumps(rank_state)}
        if in_thread:
            settings = optimizer_settings(optimizer)
            job = self._save_thread.submit(lambda: self._copy(model, optimizer, settings, texts, extra),
                                           lambda staged: self._hand_over(staged, partial))
            self._pending = (job, partial, meta)
            return
        self._remove_stale_partials(partial)
        model_state, optim_state = (self._save_state_dict(model, optimizer) if self._save_state_dict is not None
                                    else get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS))
        state = {**self._state(model_state, optim_state, texts), **(extra or {})}
        if self.async_save and not writer_starting:
            stager = self._staging(model, state)
            future = self._async_save(state, partial, stager, flat=isinstance(stager, FlatStager))
            self._pending = (future, partial, meta)
            self._pending_bytes = stager.staged_bytes if isinstance(stager, FlatStager) else _state_bytes(state)
            logger.info("checkpoint step %d: background save started after %.3fs in the loop", step,
                        time.perf_counter() - started)
            if isinstance(stager, FlatStager) and self._save_state_dict.usable and self._save_state_dict.parameters_only:
                # Later saves are taken over by a thread after the loader's state; the optimizer step waits for
                # their copy (checkpoint_background).
                self._save_thread = SaveThread()
                self._save_thread.guard(optimizer)
            return
        try:
            dcp.save(state, checkpoint_id=str(partial))
        except (Exception, CheckpointException) as err:  # a full disk, wrapped by DCP (not an Exception)
            raise self._write_failed(partial, step, _state_bytes(state), err) from None
        faults.inject_now("save", step, self.rank)
        self._complete_now(partial, meta)
        logger.info("checkpoint step %d saved to %s in %.2fs%s", step, final, time.perf_counter() - started,
                    " (synchronously: the background writer process is still starting)" if writer_starting else "")

    def _remove_stale_partials(self, partial: Path) -> None:
        """Rank 0 removes the partial directories a crash left (before the first save: every one; later: those of
        other steps, which no rank writes into); the other ranks wait for it before the first save only."""
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(f"step_*{PARTIAL_SUFFIX}"):
                if stale != partial or not self._cleaned:  # left by a crash mid-save
                    shutil.rmtree(stale, ignore_errors=True)
        if not self._cleaned:
            # Other ranks write into this save's partial directory once rank 0 removed what an earlier run left
            # there. Later saves skip the barrier: rank 0 no longer removes a directory another rank writes into.
            _barrier()
            self._cleaned = True

    def _state(self, model_state: dict[str, Any], optim_state: dict[str, Any], texts: dict[str, str]) -> dict[str, Any]:
        """The state DCP saves: a tensor the model holds under two names (tied weights) once, under its name."""
        shared = self._shared(model_state)
        return {"model": {k: v for k, v in model_state.items() if k not in shared}, "optim": optim_state, **texts}

    def _copy(self, model: nn.Module, optimizer: torch.optim.Optimizer, settings: list, texts: dict[str, str],
              extra: dict[str, Any] | None) -> dict[str, Any]:
        """In the save thread, before the next optimizer step: the state dicts and their copy into the staging
        buffers (the parameter groups' `settings` were taken by the loop)."""
        model_state, optim_state = self._save_state_dict.build(model, optimizer, settings)
        return self._stager.stage({**self._state(model_state, optim_state, texts), **(extra or {})})

    def _hand_over(self, staged: dict[str, Any], partial: Path) -> Any:
        """In the save thread, after the copy: the partial directory, and DCP's writer takes the staged state over.
        Returns DCP's future."""
        self._publications.settle()  # the previous checkpoint is renamed before stale partials are removed
        self._remove_stale_partials(partial)
        return self._async_save(staged, partial, AlreadyStaged(), flat=True)

    def _async_save(self, state: dict[str, Any], partial: Path, stager: Any, *, flat: bool) -> Any:
        """Hand `state` to DCP's background writer through `stager` (`flat`: a `FlatStager` layout, which the
        writer's planner expands); returns DCP's future."""
        in_process = self.writer == AsyncCheckpointerType.PROCESS
        return dcp.async_save(state, checkpoint_id=str(partial), process_group=self._async_group,
                              storage_writer=WriterProcessFileSystemWriter(partial) if in_process else None,
                              planner=ExpandingSavePlanner() if flat else None,
                              async_checkpointer_type=self.writer, async_stager=stager)

    def _staging(self, model: nn.Module, state: dict[str, Any]) -> DefaultStager | FlatStager:
        """The run's one stager. It keeps its CPU copy of each tensor and copies into it at the next save,
        which is safe because a save first waits for the previous one to be written (`wait`). A state of plain
        CPU tensors goes to `FlatStager` (one copy into one shared-memory buffer per dtype, one handle each to
        the writer); any other (DTensors, GPU tensors), or every state when SHARDKIT_CHECKPOINT_STAGING=dcp,
        to DCP's stager: on a GPU the copy goes to pinned memory, at full bandwidth, without a new pinning at
        every save, and for the writer process it lives in shared memory, handed over without a copy."""
        if self._stager is None and self._flat_staging and flat_stageable(state):
            self._stager = FlatStager()
            logger.info("background saves are staged in shared-memory buffers kept for the run (%s)",
                        _mib(_state_bytes(state)))
        if self._stager is None:
            on_gpu = any(parameter.device.type == "cuda" for parameter in model.parameters())
            shared = self.writer == AsyncCheckpointerType.PROCESS
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=shared,
                                                        use_async_staging=False, use_non_blocking_copy=on_gpu))
        return self._stager

    @property
    def saving_in_background(self) -> bool:
        return self._pending is not None

    def background_written(self) -> bool:
        """Whether this rank's background save (if any) has finished writing; no pending save counts as
        finished. Ranks agree on completing a save only when all report True (see the training loop)."""
        if self._pending is None:
            return True
        try:
            upload = upload_of(self._pending[0], block=False)
        except (Exception, CheckpointException):
            return True  # the save failed before DCP took it over: `wait` raises it
        return upload is not None and upload.done()

    def abandon(self) -> None:
        """Forget the background save in flight: it is never marked complete (the next run's first save removes
        its partial directory). For a job that must stop without writing (another job took its run directory)."""
        self._pending = None

    def wait(self, *, join: bool = True, agreed: bool = False) -> None:
        """Finish a background save: wait for every rank's writes, then mark it complete (rank 0, in a thread).

        Args:
            join: wait for that thread too. False at the loop's sync points: training goes on while rank 0
                marks the checkpoint complete; the next save's thread (or a later `wait()`) waits for it first.
            agreed: every rank reported its save written (the loop's sync point): no barrier is needed.
        """
        if self._pending is None:
            if join:
                self._publications.join()
            return
        started = time.perf_counter()
        future, partial, meta = self._pending
        self._pending = None
        try:
            upload_of(future, block=True).result()
        except (Exception, CheckpointException) as err:
            if meta is None:
                raise OSError(f"background saves cannot be written to {self.directory}: DCP's writer process failed "
                              f"({_first_failure(err)}); check the directory, or use --async-writer thread") from None
            raise self._write_failed(partial, meta["step"], getattr(self, "_pending_bytes", 0), err) from None
        if meta is None:
            # Rank 0's save returns once every rank's writer has written (DCP ends a save with a collective).
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            logger.info("checkpoint writer process started; the loop waited %.3fs for it",
                        time.perf_counter() - started)
            return
        faults.inject_now("save", meta["step"], self.rank)
        if not agreed:
            _barrier()  # every rank's files are written before rank 0 declares the checkpoint complete
        if self.rank == 0:
            # The marker's fsync, the renames and the pruning are file-system round trips (slow on a shared
            # file system), none of them the loop's business: a thread does them while training goes on.
            self._publications.submit(lambda: self._publish(partial, meta))
        if join:
            self._publications.join()
        logger.info("checkpoint step %d completed (background save) after %.3fs in the loop", meta["step"],
                    time.perf_counter() - started)

    def _publish(self, partial: Path, meta: dict[str, Any]) -> None:
        try:
            self._finish(partial, meta)
        except BaseException as err:  # raised in the training thread, where it next waits for the publications
            raise OSError(f"checkpoint {partial} could not be marked complete ({type(err).__name__}: {err}); "
                          "the previous checkpoints are intact") from err

    def _complete_now(self, partial: Path, meta: dict[str, Any]) -> None:
        _barrier()  # every rank's files are written before rank 0 declares the checkpoint complete
        if self.rank == 0:
            self._finish(partial, meta)
        _barrier()

    def _finish(self, partial: Path, meta: dict[str, Any]) -> None:
        """Rank 0: write the marker, rename the partial directory to its final name, prune old checkpoints."""
        marker = partial / MARKER_NAME
        # Every rank's files, with their sizes: a later resume checks them before DCP reads any.
        files = {p.name: p.stat().st_size for p in sorted(partial.iterdir()) if p.is_file()}
        with open(marker, "w") as handle:
            json.dump({**meta, "files": files}, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        final = partial.with_name(partial.name[: -len(PARTIAL_SUFFIX)])
        if final.exists():  # the same step saved again (e.g. by a run started with --resume none)
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(self.directory)
        self._prune()

    def _shared(self, model_state: dict[str, Any]) -> dict[str, str]:
        """The aliases whose name is in `model_state` too (a pipeline stage may hold only one of them)."""
        return {alias: name for alias, name in self.aliases.items() if alias in model_state and name in model_state}

    def _write_failed(self, partial: Path, step: int, needed: int, err: BaseException) -> OSError:
        """One line for a save that failed to write (a full disk, above all). The partial directory is
        removed: it never counts as a checkpoint, and its bytes would keep the disk full."""
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            free = None
        causes = _failures(err)
        full = any(getattr(c, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for c in causes) or (
            free is not None and free < needed)
        if full:
            return OSError(errno.ENOSPC, f"no space left in {self.directory} for checkpoint step {step}: it needs "
                                         f"about {_mib(needed)} for this rank's part, {_mib(free or 0)} are free; "
                                         "free space or choose another --checkpoint-dir (the previous checkpoints "
                                         "are intact)")
        return OSError(f"checkpoint step {step} could not be written to {self.directory} ({_first_failure(err)}); "
                       "the previous checkpoints are intact")

    def _prune(self) -> None:
        for old in _complete(self.directory)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             world_size: int, extra: dict[str, Any] | None = None) -> LoadedCheckpoint:
        """Load a complete checkpoint into model, optimizer and scheduler (collective), and the
        entries named in `extra` (shaped like what was saved; tensors are loaded in place)."""
        path = Path(path)
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} is damaged: {problem}; resume from another one "
                             "(--resume auto skips damaged ones) or start over with --resume none")
        meta = read_marker(path)
        started = time.perf_counter()
        same_topology = meta.get("world_size") == world_size
        model_state, optim_state = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        shared = self._shared(model_state)
        rank_key = f"rank_{self.rank}" if same_topology else "rank_0"
        state = {"model": {k: v for k, v in model_state.items() if k not in shared}, "optim": optim_state,
                 "scheduler": "", "train": "", rank_key: "", **(extra or {})}
        try:
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeFileSystemReader(path),
                     planner=SafeLoadPlanner())
        except (CheckpointException, EOFError, OSError, RuntimeError, ValueError) as err:
            # Files of the listed sizes whose bytes are damaged: name the checkpoint, not DCP's internals.
            raise ValueError(f"checkpoint {path} cannot be loaded ({_first_failure(err)}); resume from another "
                             "one with --resume DIR, or start over with --resume none") from err
        loaded_model = {**state["model"], **{alias: state["model"][name] for alias, name in shared.items()}}
        set_state_dict(model, optimizer, model_state_dict=loaded_model, optim_state_dict=state["optim"],
                       options=STATE_DICT_OPTIONS)
        scheduler.load_state_dict(json.loads(state["scheduler"]))
        step = json.loads(state["train"])["step"]
        rank_state = json.loads(state[rank_key])
        logger.info("resumed from %s at step %d (loaded in %.2fs)", path, step, time.perf_counter() - started)
        return LoadedCheckpoint(step=step, rank_state=rank_state, same_topology=same_topology, meta=meta,
                                extra={key: state[key] for key in extra or {}})


def _writer_type(async_writer: str) -> AsyncCheckpointerType:
    """DCP's executor for `async_writer`; a thread when no process group exists (DCP's writer process needs one)."""
    if async_writer not in ASYNC_WRITERS:
        raise ValueError(f"--async-writer must be one of {ASYNC_WRITERS}, got {async_writer!r}")
    if async_writer == "process" and not dist.is_initialized():
        logger.info("background saves are written in a thread: one process without a process group "
                    "(DCP's writer process needs one)")
        return AsyncCheckpointerType.THREAD
    return AsyncCheckpointerType(async_writer)


def _first_failure(err: BaseException) -> str:
    """One line for a failed DCP load: a CheckpointException carries one (exception, traceback) per rank."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = min(failures.items())
        err = failure[0] if isinstance(failure, tuple) else failure
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


def _failures(err: BaseException) -> list[BaseException]:
    """`err`, its causes and contexts, and the per-rank failures a CheckpointException carries."""
    found, queue = [], [err]
    while queue:
        current = queue.pop()
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        queue += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            queue += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return [e for e in found if isinstance(e, BaseException)]


def _state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: about what this rank writes."""
    if isinstance(state, torch.Tensor):
        local = getattr(state, "_local_tensor", state)  # a DTensor writes its local shard
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(value) for value in state)
    return len(state) if isinstance(state, str) else 0


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _fsync_dir(path: Path) -> None:
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
