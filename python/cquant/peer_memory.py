"""GPU memory that every rank of a process group can read and write (torch's symmetric memory),
for cquant's Ulysses exchange (cquant.ulysses, CQUANT_ULYSSES_TRANSPORT=p2p).

Each rank allocates one workspace a (group, device); torch maps the peers' workspaces into this
process, so a copy kernel writes a peer's memory directly and a memcpy reads it through the copy
engines, over NVLink (or PCIe peer access), without NCCL's kernels or its staging. A barrier (a
tiny kernel on the current stream, so CUDA graphs capture it) orders those accesses across ranks.

Setting a workspace up is collective and blocks the host (torch exchanges memory handles), so it
is never done while a CUDA graph is being captured: workspace() then returns None and the caller
falls back to NCCL. The eager calls before a capture (cquant.cuda_graph's warm-up) set it up.
A larger call replaces the workspace; the old one stays alive, as graphs captured with it read it.

torch.distributed.destroy_process_group can hang while symmetric memory mapped from the peers is
alive (seen with torch 2.11 and NCCL 2.28), so with the first workspace cquant wraps it: the
workspaces of the groups it destroys are released first (release()).
"""

from __future__ import annotations

import functools
import gc
import os
import warnings

TRANSPORT_SETTING = "CQUANT_ULYSSES_TRANSPORT"
TRANSPORTS = ("auto", "p2p", "nccl")
ALIGN = 256  # bytes: every region starts on a boundary the kernels' vector loads accept

_workspaces = {}  # (group name, device index) -> Workspace
_kept = []  # replaced workspaces: graphs captured with them still read them
_refused = {}  # group name -> why symmetric memory cannot serve it


def transport():
    """CQUANT_ULYSSES_TRANSPORT, read at each call: 'auto' (default: p2p where the group's GPUs can
    map each other's memory, else NCCL), 'p2p' (raise where they cannot) or 'nccl'."""
    value = os.environ.get(TRANSPORT_SETTING, "auto").strip().lower() or "auto"
    if value not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_SETTING}={os.environ[TRANSPORT_SETTING]!r}; expected one of "
                         f"{', '.join(TRANSPORTS)}")
    return value


class Workspace:
    """nbytes of symmetric memory on `device` for the ranks of `group`."""

    def __init__(self, torch, group, device, nbytes):
        import torch.distributed._symmetric_memory as symm_mem

        name = self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            with warnings.catch_warnings():  # deprecated in newer torch, where rendezvous does it
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(name)
        self.nbytes, self.device, self._torch = nbytes, device, torch
        with torch.inference_mode(False):  # plain tensors: later calls may run outside inference mode
            self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, name)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        self._views = {}

    def view(self, rank, offset, shape, dtype):
        """Rank `rank`'s workspace from byte `offset` as a contiguous tensor (cached: the views of
        a layer's calls are made once)."""
        key = (rank, offset, tuple(shape), dtype)
        t = self._views.get(key)
        if t is None:
            with self._torch.inference_mode(False):  # written to later in and out of inference mode
                t = self._views[key] = self.handle.get_buffer(rank, tuple(shape), dtype, offset // dtype.itemsize)
        return t

    def barrier(self, channel):
        """Every rank's current stream reaches this point before any goes on."""
        self.handle.barrier(channel=channel)


def aligned(nbytes):
    return -(-nbytes // ALIGN) * ALIGN


def workspace(torch, group, device, nbytes):
    """The group's workspace of at least nbytes on device, or None where NCCL must carry the call
    (the transport setting, a capture with no workspace large enough, or symmetric memory refused)."""
    choice = transport()
    if choice == "nccl" or device.type != "cuda":
        return None
    name = group.group_name
    if name in _refused:
        if choice == "p2p":
            raise RuntimeError(f"{TRANSPORT_SETTING}=p2p: {_refused[name]}")
        return None
    key = (name, device.index)
    ws = _workspaces.get(key)
    if ws is not None and ws.nbytes >= nbytes:
        return ws
    if torch.cuda.is_current_stream_capturing():
        return None  # setting up blocks the host; the next eager call does it
    try:
        new = Workspace(torch, group, device, aligned(max(nbytes, ws.nbytes if ws else 0)))
    except Exception as e:  # noqa: BLE001 - any failure to map the peers means: NCCL carries the exchange
        _refused[name] = f"symmetric memory is not available for this group ({type(e).__name__}: {e})"
        if choice == "p2p":
            raise RuntimeError(f"{TRANSPORT_SETTING}=p2p: {_refused[name]}") from e
        warnings.warn(f"cquant Ulysses: {_refused[name]}; NCCL carries the exchange", RuntimeWarning, stacklevel=3)
        return None
    if ws is not None:
        _kept.append(ws)
    _workspaces[key] = new
    _release_before_destroy()
    return new


def release(group_name=None):
    """Release the workspaces of one group (all with None) once their devices are done with them;
    a later call sets a new one up. Graphs captured with them must not be replayed afterwards."""
    import torch

    def going(ws):
        return group_name is None or ws.group_name == group_name

    devices = {ws.device for ws in (*_workspaces.values(), *_kept) if going(ws)}
    if not devices:
        return
    for device in devices:
        torch.cuda.synchronize(device)
    for key in [k for k, ws in _workspaces.items() if going(ws)]:
        del _workspaces[key]
    _kept[:] = [ws for ws in _kept if not going(ws)]
    gc.collect()  # the handles go now, not at some later collection


def _release_before_destroy():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_cquant_releases_peer_memory", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        if group is None or group is c10d.GroupMember.WORLD:
            release()  # every group goes
        elif getattr(group, "group_name", None):
            release(group.group_name)
        return original(group)

    destroy_process_group._cquant_releases_peer_memory = True
    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group
