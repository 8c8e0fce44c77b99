"""Splice audio encoder frames into the LLM's input embeddings at the audio placeholder tokens.

:func:`inject_audio` replaces each ``<|audioplaceholder|>`` of a batch of token embeddings by the frames of
one utterance, re-pads the rows, and builds the next-token labels of the spliced sequence. All copies are one
``index_put`` call of a fixed shape (no per-frame Python loops, no ``nonzero``: with the longest row given and the
checks off, no host synchronisation); gradients flow into both the token and the audio embeddings.
"""

import torch

IGNORE_INDEX = -100


def audio_positions(
    input_ids: torch.Tensor, placeholder_id: int, input_lens: torch.Tensor | None = None, padding_side: str = "right"
) -> torch.Tensor:
    """``(K, 2)`` long tensor of the ``(row, column)`` of every placeholder, in row-major order.

    With ``input_lens``, placeholders in the padding (as given by ``padding_side``) are ignored.
    """
    hits = input_ids == placeholder_id
    if input_lens is not None:
        hits &= _valid_mask(input_lens, input_ids.shape[1], padding_side)
    return hits.nonzero()


def _valid_mask(lens: torch.Tensor, length: int, padding_side: str) -> torch.Tensor:
    """``(B, length)`` True on the real positions of rows padded on ``padding_side``."""
    columns = torch.arange(length, device=lens.device)
    if padding_side == "right":
        return columns[None, :] < lens[:, None]
    if padding_side == "left":
        return columns[None, :] >= (length - lens)[:, None]
    raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")


def inject_audio(
    token_embeds: torch.Tensor,
    input_ids: torch.Tensor,
    input_lens: torch.Tensor,
    audio_embeds: torch.Tensor,
    audio_lens: torch.Tensor,
    placeholder_id: int,
    loss_mask: torch.Tensor | None = None,
    pad_multiple: int = 1,
    padding_side: str = "right",
    input_padding_side: str | None = None,
    out_len: int | None = None,
    check: bool = True,
) -> dict[str, torch.Tensor]:
    """Replace the audio placeholders of ``input_ids`` by audio frames.

    Args:
        token_embeds: ``(B, L, D)`` embeddings of ``input_ids``.
        input_ids: ``(B, L)`` token ids.
        input_lens: ``(B,)`` real lengths of the rows.
        audio_embeds: ``(N, T, D)`` encoder outputs, one row per placeholder, in row-major placeholder order
            (row 0's placeholders left to right, then row 1's, ...).
        audio_lens: ``(N,)`` real frame counts (each ``<= T``).
        placeholder_id: The id of ``<|audioplaceholder|>``.
        loss_mask: ``(B, L)`` bool, True on the tokens to learn (the template's mask); ``None``: no labels
            (all ``-100``, for inference).
        pad_multiple: The output length is rounded up to a multiple of this (sequence / tensor parallelism).
        padding_side: Where the output rows are padded: ``right``, or ``left`` (batched generation).
        input_padding_side: Where the *input* rows are padded; ``None``: same as ``padding_side``.
        out_len: The longest spliced row, when the caller knows it on the host (a training batch's lengths):
            else it is read from the device.
        check: Check that the lengths lie in range and that placeholders and audio match one to one (host
            reads of device values); a training step whose batch was built consistently skips them.

    Returns:
        A dict with

        - ``embeds`` ``(B, L', D)``: spliced rows, zeros in the padding;
        - ``lens`` ``(B,)``: real lengths;
        - ``labels`` ``(B, L')``: at position ``i`` the id of the token at ``i + 1`` when that is a text token
          whose loss mask is True, else ``-100`` (so audio frames, placeholders, prompt and padding are never
          targets; the last frame of an audio *does* predict a trained token right after it);
        - ``positions`` ``(B, L')``: position ids ``0 .. len-1`` of the real positions, 0 in the padding;
        - ``mask`` ``(B, L')`` bool: True on real positions;
        - ``audio_mask`` ``(B, L')`` bool: True on the audio frames.
    """
    if token_embeds.dim() != 3 or input_ids.dim() != 2 or token_embeds.shape[:2] != input_ids.shape:
        raise ValueError(
            f"token_embeds (B, L, D) and input_ids (B, L) disagree: {tuple(token_embeds.shape)} vs "
            f"{tuple(input_ids.shape)}"
        )
    if audio_embeds.dim() != 3 or audio_embeds.shape[2] != token_embeds.shape[2]:
        raise ValueError(f"audio_embeds must be (N, T, D={token_embeds.shape[2]}), got {tuple(audio_embeds.shape)}")
    if loss_mask is not None and loss_mask.shape != input_ids.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    device = token_embeds.device
    batch, length, dim = token_embeds.shape
    input_ids = input_ids.to(device)
    input_lens = torch.as_tensor(input_lens, device=device).long()
    audio_lens = torch.as_tensor(audio_lens, device=device).long()
    num_audio, max_frames = audio_embeds.shape[:2]
    if audio_lens.shape != (num_audio,):
        raise ValueError(f"audio_lens must have shape ({num_audio},), got {tuple(audio_lens.shape)}")
    if check and num_audio and (audio_lens.min() < 0 or audio_lens.max() > max_frames):
        raise ValueError(f"audio_lens must lie in [0, {max_frames}], got {audio_lens.tolist()}")
    if input_lens.shape != (batch,) or (check and batch and (input_lens.min() < 0 or input_lens.max() > length)):
        raise ValueError(f"input_lens must be ({batch},) values in [0, {length}], got {input_lens.tolist()}")

    valid = _valid_mask(input_lens, length, input_padding_side or padding_side)
    is_audio = (input_ids == placeholder_id) & valid
    if check:
        found = int(is_audio.sum())
        if found != num_audio:
            per_row = is_audio.sum(1).tolist()
            raise ValueError(
                f"{found} audio placeholders in input_ids (per row: {per_row}) but {num_audio} audio "
                "embeddings were given; they must match one to one"
            )

    # Every copy below is a scatter with a fixed shape: positions that copy nothing are sent to one extra column
    # (``out_len``, dropped at the end) instead of being selected with ``nonzero``, which would make the host wait
    # for the device to count them.
    flat_audio = is_audio.flatten()
    audio_index = (flat_audio.cumsum(0) - 1).view(batch, length)  # placeholder k of each position, row-major
    # (row, column) of each placeholder k: the flat positions scattered into slot k (others into a spare slot N)
    slots = torch.where(flat_audio, audio_index.flatten(), num_audio)
    where = torch.zeros(num_audio + 1, dtype=torch.long, device=device)
    where = where.scatter(0, slots, torch.arange(batch * length, device=device))[:num_audio]
    audio_rows, audio_cols = where // max(length, 1), where % max(length, 1)

    # How many output positions each input position takes: 1 per text token, the frame count per placeholder.
    frames_here = audio_lens[audio_index.clamp(min=0)] if num_audio else torch.zeros_like(input_ids, dtype=torch.long)
    width = torch.where(is_audio, frames_here, valid.long())
    end = width.cumsum(1)
    start = end - width  # output column of each input position, before the row's offset
    lens = end[:, -1] if length else torch.zeros(batch, dtype=torch.long, device=device)
    if out_len is None:
        out_len = int(lens.max()) if batch else 0
    out_len = -(-out_len // pad_multiple) * pad_multiple
    offset = (out_len - lens) if padding_side == "left" else torch.zeros_like(lens)
    start = start + offset[:, None]
    spare = out_len  # the extra column

    is_text = valid & ~is_audio
    rows = torch.arange(batch, device=device)[:, None].expand(batch, length)
    text_dest = torch.where(is_text, start, spare)
    frame_ok = torch.arange(max_frames, device=device)[None, :] < audio_lens[:, None]  # (N, T)
    frame_dest = torch.where(
        frame_ok, start[audio_rows, audio_cols][:, None] + torch.arange(max_frames, device=device), spare
    )
    frame_rows = audio_rows[:, None].expand(num_audio, max_frames)
    # one scatter of all text vectors and audio frames into the zero-padded output
    values = torch.cat([token_embeds.reshape(-1, dim), audio_embeds.reshape(-1, dim).to(token_embeds.dtype)])
    indices = (
        torch.cat([rows.reshape(-1), frame_rows.reshape(-1)]),
        torch.cat([text_dest.reshape(-1), frame_dest.reshape(-1)]),
    )
    embeds = token_embeds.new_zeros(batch, out_len + 1, dim).index_put(indices, values)[:, :out_len]

    out_valid = _valid_mask(lens, out_len, padding_side)
    audio_mask = torch.zeros(batch, out_len + 1, dtype=torch.bool, device=device)
    audio_mask = audio_mask.index_put((frame_rows.reshape(-1), frame_dest.reshape(-1)), frame_ok.reshape(-1))
    audio_mask = audio_mask[:, :out_len]

    labels = torch.full((batch, out_len), IGNORE_INDEX, dtype=torch.long, device=device)
    if loss_mask is not None and out_len > 1:
        trained = is_text & loss_mask.to(device=device, dtype=torch.bool)
        targets = torch.full((batch, out_len + 1), IGNORE_INDEX, dtype=torch.long, device=device)
        targets = targets.scatter(1, torch.where(trained, start, spare), input_ids.long())
        labels[:, :-1] = targets[:, 1:out_len]

    positions = (torch.arange(out_len, device=device)[None, :] - offset[:, None]).clamp(min=0)
    positions = positions.masked_fill(~out_valid, 0)
    return {
        "embeds": embeds,
        "lens": lens,
        "labels": labels,
        "positions": positions,
        "mask": out_valid,
        "audio_mask": audio_mask,
    }
