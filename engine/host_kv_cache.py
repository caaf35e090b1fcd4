"""The host tier's memory and its copies: KV blocks evicted from the device cache copied into
host slots, and slots copied back into device blocks, as the KV cache manager decides
(engine/host_block_index.py keeps the index; this module only moves bytes).

Host memory is pinned when the cache is on a GPU, so that copies run on the copy engines
without the host waiting. A store (device to host) is queued on the compute stream: the block
is about to be written by the step it is queued before, and stream order keeps the copy ahead
of that write. A load (host to device) runs on a side stream, behind the work already queued,
so it overlaps the steps that follow; the request it serves waits (the scheduler's
WAITING_FOR_HOST_KV) until rank 0 sees its event done, and the step that then uses the blocks
makes the compute stream wait for that event on every rank. On the CPU every copy is done when
the call returns."""

from __future__ import annotations

import logging

import torch

from kvfleet.engine.kv_transfers import KVTransfers, TransfersDone

logger = logging.getLogger(__name__)

# Device memory for the gather/scatter buffers (one for stores, one for loads): copies of more
# blocks go through them in turns. It sits outside the memory profile, within what
# --gpu-memory-utilization leaves over.
STAGING_BYTES = 64 * 2**20


class HostKVCache:
    def __init__(
        self, kv_caches: list[torch.Tensor], num_slots: int, device: torch.device, track: bool
    ) -> None:
        """`kv_caches`: each layer's device cache, (2, blocks, block_size, heads, head_dim).
        `track`: this rank reports its copies done (rank 0, whose scheduler waits for them)."""
        self.caches = kv_caches
        self.track = track
        self.num_slots = num_slots
        self.device = device
        cuda = device.type == "cuda"
        first = kv_caches[0]
        block_shape = tuple(first.shape[2:])
        num_layers = len(kv_caches)
        # A slot is contiguous over every layer (layer, k/v, token, head, dim): one copy a slot.
        self.host = torch.empty(
            (num_slots, num_layers, 2, *block_shape), dtype=first.dtype, pin_memory=cuda
        )
        slot_bytes = self.host[0].numel() * self.host.element_size()
        self.chunk = max(1, min(num_slots, STAGING_BYTES // slot_bytes))
        stage_shape = (self.chunk, num_layers, 2, *block_shape)
        self._store_stage = torch.empty(stage_shape, dtype=first.dtype, device=device)
        self._load_stage = torch.empty(stage_shape, dtype=first.dtype, device=device)
        self.stream = torch.cuda.Stream(device) if cuda else None
        # Rank 0's copies not yet seen complete, with the event recorded after them (None on
        # the CPU: complete at once).
        self._stores: list[tuple[list[int], torch.cuda.Event | None, bool]] = []
        self._loads: list[tuple[int, torch.cuda.Event | None, bool]] = []
        # Every rank: load id -> the event the compute stream waits for before using its blocks.
        self._load_events: dict[int, torch.cuda.Event] = {}

    def apply(self, transfers: KVTransfers) -> None:
        """Queue a step's copies, before its forward pass."""
        if transfers.stores:
            self._store(transfers.stores)
        if self.stream is not None:
            for load_id in transfers.loads_ready:
                event = self._load_events.pop(load_id, None)
                if event is not None:
                    torch.cuda.current_stream(self.device).wait_event(event)
        for load_id, slots, block_ids in transfers.loads:
            self._load(load_id, slots, block_ids)

    def _store(self, stores: list[tuple[int, int, int]]) -> None:
        tickets = [t for _, _, t in stores]
        try:
            self._copy_out(stores)
        except RuntimeError:
            # Those blocks are not kept; the requests that want them compute them again.
            self._failed("storing", len(stores))
            if self.track:
                self._stores.append((tickets, None, False))
            return
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        if self.track:
            self._stores.append((tickets, event, True))

    def _copy_out(self, stores: list[tuple[int, int, int]]) -> None:
        stage = self._store_stage
        with torch.inference_mode():
            for start in range(0, len(stores), self.chunk):
                part = stores[start : start + self.chunk]
                n = len(part)
                blocks = self._indices([b for b, _, _ in part])
                for layer, cache in enumerate(self.caches):
                    stage[:n, layer] = cache[:, blocks].transpose(0, 1)
                for i, (_, slot, _) in enumerate(part):
                    self.host[slot].copy_(stage[i], non_blocking=True)

    def _load(self, load_id: int, slots: list[int], block_ids: list[int]) -> None:
        stream = self.stream
        ok = True
        event = None
        if stream is None:
            try:
                self._copy_in(slots, block_ids)
            except RuntimeError:
                self._failed("loading", len(slots))
                ok = False
        else:
            # Behind everything queued so far: the blocks' last readers, this step's stores.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                try:
                    self._copy_in(slots, block_ids)
                except RuntimeError:
                    self._failed("loading", len(slots))
                    ok = False
                # Also after a failure: the blocks are reused only once what was queued is done.
                event = torch.cuda.Event()
                event.record(stream)
            self._load_events[load_id] = event
        if self.track:
            self._loads.append((load_id, event, ok))

    def _failed(self, what: str, num_blocks: int) -> None:
        """A copy failed. Rank 0 falls back to computing the blocks; another rank cannot tell
        rank 0, whose KV would then differ from its own: it fails, and the engine with it."""
        if not self.track:
            raise
        logger.exception("%s %d KV blocks in host memory failed", what, num_blocks)

    def _copy_in(self, slots: list[int], block_ids: list[int]) -> None:
        stage = self._load_stage
        with torch.inference_mode():
            for start in range(0, len(slots), self.chunk):
                part = slots[start : start + self.chunk]
                n = len(part)
                for i, slot in enumerate(part):
                    stage[i].copy_(self.host[slot], non_blocking=True)
                blocks = self._indices(block_ids[start : start + n])
                for layer, cache in enumerate(self.caches):
                    cache[:, blocks] = stage[:n, layer].transpose(0, 1)

    def _indices(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device, through pinned memory: a copy from pageable memory may make
        the host wait for the stream, which is behind the step still running."""
        indices = torch.tensor(ids, dtype=torch.long)
        if self.stream is None:
            return indices
        return indices.pin_memory().to(self.device, non_blocking=True)

    def take_done(self) -> TransfersDone:
        """The copies (rank 0's) complete since the last call, each in the order queued."""
        done = TransfersDone()
        while self._stores and _complete(self._stores[0][1]):
            tickets, _, ok = self._stores.pop(0)
            (done.stored if ok else done.store_failed).extend(tickets)
        while self._loads and _complete(self._loads[0][1]):
            load_id, _, ok = self._loads.pop(0)
            done.loaded.append((load_id, ok))
        return done


def _complete(event: torch.cuda.Event | None) -> bool:
    return event is None or event.query()
