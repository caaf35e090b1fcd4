"""CUDA graphs for decode steps: the whole forward pass of a batch of one-token rows is captured
once per row count and replayed, so a step costs one launch instead of hundreds. A row is a
decode token, or a prompt token run as a decode over its own prefix (the runner decides which
steps qualify: `model_runner.fits_decode_graph`). Sizes are captured in stages
(`graph_schedule`: a few before ready, the rest while serving); a batch pads to a captured size;
padded rows write no KV (slot -1) and attend to nothing (sequence length 0). Sizes from
`cascade_min_rows` up get a second graph that splits off a prefix all rows share (cascade
attention, `kernels.paged_attention`); its length is a device buffer set before each replay. With
LoRA the token -> adapter slot map is another input buffer (padded rows: -1, the base model)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kvfleet.engine.attention_metadata import AttentionMetadata, attention_context
from kvfleet.engine.graph_schedule import GraphSchedule
from kvfleet.engine.layers.lora import lora_context

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8 and then every multiple of 8, up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(
        self,
        model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        cascade_min_rows: int | None = None,
        *,
        lora: bool = False,
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.cascade_min_rows = cascade_min_rows
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.prefix_len = torch.zeros(1, dtype=torch.long, device=device)
        self.lora_slots = torch.full((n,), -1, dtype=torch.int32, device=device) if lora else None
        # Keyed by (rows, cascade).
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.schedule = GraphSchedule(self.sizes, [])
        # One memory pool for every graph, made at the first capture.
        self.pool = None

    def variants(self, sizes: list[int] | None = None) -> list[tuple[int, bool]]:
        """The graphs of `sizes` (default: every size): plain, and with the shared-prefix pass
        from cascade_min_rows rows up."""
        sizes = self.sizes if sizes is None else sizes
        plain = [(bs, False) for bs in sizes]
        if self.cascade_min_rows is None:
            return plain
        return plain + [(bs, True) for bs in sizes if bs >= self.cascade_min_rows]

    def replay_size(self, rows: int) -> int | None:
        """The captured size a batch of `rows` replays, or None to run it eagerly."""
        return self.schedule.replay_size(rows)

    def _meta(self, bs: int, cascade: bool) -> AttentionMetadata:
        # Host-side lengths are not available inside a graph; the graph-safe backend reads only
        # the device tensors.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens_cpu=[],
            query_start_loc_cpu=[],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            cascade_prefix_len=self.prefix_len if cascade else None,
        )

    @torch.inference_mode()
    def clear_inputs(self) -> None:
        """Every row of the input buffers a padded row: no KV write, nothing attended. The
        warm-up pass before a capture runs eagerly on the buffers as the last replay left them,
        whose rows beyond its batch may hold an older, larger batch's slots, blocks that now
        belong to other sequences or to the prefix cache. Queued behind that replay."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        self.input_ids.zero_()
        self.positions.zero_()
        self.block_tables.zero_()
        self.prefix_len.zero_()
        if self.lora_slots is not None:
            self.lora_slots.fill_(-1)

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture the graphs of `sizes` (default: every size not captured yet). Between steps
        only: the capture's own forward passes run on the device's stream."""
        sizes = self.schedule.pending if sizes is None else sizes
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.clear_inputs()
        # Largest first: later, smaller graphs reuse the memory pool of the largest.
        for key in sorted(self.variants(sizes), reverse=True):
            bs = key[0]
            slots = None if self.lora_slots is None else self.lora_slots[:bs]
            with attention_context(self._meta(*key)), lora_context(slots):
                self.model(self.input_ids[:bs], self.positions[:bs])  # warm up kernels
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[key] = self.model(self.input_ids[:bs], self.positions[:bs])
            self.graphs[key] = graph
        torch.cuda.synchronize()
        for bs in sizes:
            self.schedule.mark_captured(bs)
        logger.log(
            logging.INFO if self.schedule.done or len(sizes) > 1 else logging.DEBUG,
            "captured CUDA graphs for decode batch sizes %s (%d of %d sizes; a shared-prefix "
            "pass from %s rows)%s",
            sorted(sizes),
            len(self.schedule.captured),
            len(self.sizes),
            self.cascade_min_rows if self.cascade_min_rows is not None else "no",
            "" if self.schedule.done else f"; the rest while serving: {self.schedule.pending}",
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: np.ndarray,
        slots: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        bs: int,
        prefix_len: int = 0,
        lora_slots: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Replay the graph of `bs` rows (replay_size's answer) for these rows. `prefix_len` >
        0: every row's context starts with that many tokens in the same blocks (the runner
        checked), and the step is at least `cascade_min_rows` rows. `lora_slots`: each row's
        adapter slot (None: the base model for all)."""
        n = len(positions)
        key = (bs, prefix_len > 0)
        if prefix_len:
            self.prefix_len.fill_(prefix_len)
        width = block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(slots), non_blocking=True)
        self.seq_lens[:n].copy_(torch.from_numpy(seq_lens), non_blocking=True)
        self.block_tables[:n, :width].copy_(torch.from_numpy(block_tables), non_blocking=True)
        if self.lora_slots is not None:
            if lora_slots is None:
                self.lora_slots[:bs].fill_(-1)
            else:
                self.lora_slots[:n].copy_(torch.from_numpy(lora_slots), non_blocking=True)
                self.lora_slots[n:bs].fill_(-1)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].zero_()
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
        self.graphs[key].replay()
        return self.outputs[key][:n]
