"""Splice audio encoder frames into the LLM's input embeddings at the audio placeholder tokens.

:func:`inject_audio` replaces each ``<|audioplaceholder|>`` of a batch of token embeddings by the frames of
one utterance, re-pads the rows, and builds the next-token labels of the spliced sequence. All copies are one
``index_put`` call (no per-frame Python loops); gradients flow into both the token and the audio embeddings.
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
    if num_audio and (audio_lens.min() < 0 or audio_lens.max() > max_frames):
        raise ValueError(f"audio_lens must lie in [0, {max_frames}], got {audio_lens.tolist()}")
    if input_lens.shape != (batch,) or (batch and (input_lens.min() < 0 or input_lens.max() > length)):
        raise ValueError(f"input_lens must be ({batch},) values in [0, {length}], got {input_lens.tolist()}")

    valid = _valid_mask(input_lens, length, input_padding_side or padding_side)
    is_audio = (input_ids == placeholder_id) & valid
    audio_rows, audio_cols = is_audio.nonzero(as_tuple=True)  # row-major = the audio order
    if audio_rows.numel() != num_audio:
        per_row = is_audio.sum(1).tolist()
        raise ValueError(
            f"{audio_rows.numel()} audio placeholders in input_ids (per row: {per_row}) but {num_audio} audio "
            "embeddings were given; they must match one to one"
        )

    # How many output positions each input position takes: 1 per text token, the frame count per placeholder.
    width = valid.long()
    width[audio_rows, audio_cols] = audio_lens
    end = width.cumsum(1)
    start = end - width  # output column of each input position, before the row's offset
    lens = end[:, -1] if length else torch.zeros(batch, dtype=torch.long, device=device)
    out_len = int(lens.max()) if batch else 0
    out_len = -(-out_len // pad_multiple) * pad_multiple
    offset = (out_len - lens) if padding_side == "left" else torch.zeros_like(lens)
    start = start + offset[:, None]

    is_text = valid & ~is_audio
    text_rows, text_cols = is_text.nonzero(as_tuple=True)
    text_dest = start[text_rows, text_cols]
    frame_mask = torch.arange(max_frames, device=device)[None, :] < audio_lens[:, None]  # (N, T)
    utt, frame = frame_mask.nonzero(as_tuple=True)
    frame_rows = audio_rows[utt]
    frame_dest = start[frame_rows, audio_cols[utt]] + frame
    # one scatter of all text vectors and audio frames into the zero-padded output
    values = torch.cat([token_embeds[text_rows, text_cols], audio_embeds[utt, frame].to(token_embeds.dtype)])
    indices = (torch.cat([text_rows, frame_rows]), torch.cat([text_dest, frame_dest]))
    embeds = token_embeds.new_zeros(batch, out_len, dim).index_put(indices, values)

    out_valid = _valid_mask(lens, out_len, padding_side)
    audio_mask = torch.zeros(batch, out_len, dtype=torch.bool, device=device)
    audio_mask[frame_rows, frame_dest] = True

    labels = torch.full((batch, out_len), IGNORE_INDEX, dtype=torch.long, device=device)
    if loss_mask is not None and out_len > 1:
        targets = torch.full_like(labels, IGNORE_INDEX)
        trained = is_text & loss_mask.to(device=device, dtype=torch.bool)
        rows, cols = trained.nonzero(as_tuple=True)
        targets[rows, start[rows, cols]] = input_ids[rows, cols].long()
        labels[:, :-1] = targets[:, 1:]

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
