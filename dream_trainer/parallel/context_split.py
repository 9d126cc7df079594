"""Which positions of a sequence each context-parallel rank holds (``parallel.context``
explains the split): chunk ``r`` and ``2cp-1-r`` of ``2 x cp`` with load balancing, chunk ``r``
of ``cp`` without."""

from __future__ import annotations

import torch


def sequence_positions(length: int, cp: int, rank: int, balanced: bool) -> torch.Tensor:
    """The positions of a ``length``-long sequence that context-parallel rank ``rank`` of
    ``cp`` holds, in the order it holds them: chunks ``rank`` and ``2cp-1-rank`` of ``2cp``
    when ``balanced``, else chunk ``rank`` of ``cp``."""
    size = length // (2 * cp if balanced else cp)
    return torch.cat([torch.arange(chunk * size, (chunk + 1) * size)
                      for chunk in held_chunks(cp, rank, balanced)])


def held_chunks(cp: int, rank: int, balanced: bool) -> tuple[int, ...]:
    """The chunks context-parallel rank ``rank`` of ``cp`` holds, in its order: ``rank`` and
    ``2cp-1-rank`` of ``2cp`` when ``balanced``, else ``rank`` of ``cp``."""
    return (rank, 2 * cp - 1 - rank) if balanced else (rank,)


def split_problem(length: int, cp: int, balanced: bool) -> str | None:
    """Why a sequence of ``length`` cannot be split over ``cp`` ranks, or None."""
    chunks = 2 * cp if balanced else cp
    if length % chunks == 0:
        return None
    how = (f"2 x context_parallel = {chunks} chunks (a head and a tail per rank, "
           "context_parallel_load_balance=True)" if balanced
           else f"context_parallel = {chunks} chunks")
    return (f"a sequence of {length} positions does not split into {how}: pad or cut the "
            f"sequences to a multiple of {chunks}, or change context_parallel")


class SequenceSplit:
    """This rank's part of sequences of one length: which positions it holds, in chunks, and
    how to put the keys gathered from every rank (in rank order) back in position order."""

    def __init__(self, length: int, cp: int, rank: int, balanced: bool,
                 device: torch.device) -> None:
        self.length = length
        self.local = sequence_positions(length, cp, rank, balanced).to(device)
        gathered = torch.cat([sequence_positions(length, cp, peer, balanced)
                              for peer in range(cp)]).to(device)
        self.natural_order = torch.argsort(gathered)
        """Where each position's key is among the gathered ones (rank order)."""
        chunks = 2 * cp if balanced else cp
        self.chunk = length // chunks
        # From the chunk numbers, not read back from ``local``: a plan's tensors have no values.
        self.starts = [chunk * self.chunk for chunk in held_chunks(cp, rank, balanced)]
        """The first position of each chunk this rank holds, in its order."""
        self._bands: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def bands(self, window: int) -> list[tuple[int, torch.Tensor]]:
        """For each chunk this rank holds, the first key position it can see under a sliding
        window of ``window`` keys (a query at ``p`` sees keys ``p - window < k <= p``, as
        transformers' masks) and the boolean mask of its queries over the keys from there to
        the chunk's end: ``[chunk, end - first]``, at most ``chunk + window - 1`` wide."""
        if window not in self._bands:
            device = self.local.device
            rows = torch.arange(self.chunk, device=device).unsqueeze(1)
            bands = []
            for start in self.starts:
                first = max(0, start - window + 1)
                keys = torch.arange(first, start + self.chunk, device=device).unsqueeze(0)
                queries = rows + start
                bands.append((first, (keys <= queries) & (keys > queries - window)))
            self._bands[window] = bands
        return self._bands[window]

    def take(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """``tensor``'s rows at this rank's positions along ``dim``."""
        return tensor.index_select(dim, self.local)
