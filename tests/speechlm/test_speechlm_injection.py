"""Audio placeholder injection (speechtrain.speechlm.injection)."""

import pytest
import torch

from speechtrain.speechlm.injection import IGNORE_INDEX, audio_positions, inject_audio

P = 99  # the placeholder id
D = 4


def embed(ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings that encode their id, so positions can be read back."""
    return ids.float()[..., None].repeat(1, 1, D) + torch.arange(D) / 10


def reference(ids_rows, masks, audio, audio_lens):
    """Per-row, per-token loop: the expected (embeds rows, labels rows) without padding."""
    k = 0
    rows, labels = [], []
    for ids, mask in zip(ids_rows, masks):
        vectors, targets = [], []  # targets: (id, trained) of each output position; None for audio frames
        for token, trained in zip(ids, mask):
            if token == P:
                for j in range(audio_lens[k]):
                    vectors.append(audio[k, j])
                    targets.append(None)
                k += 1
            else:
                vectors.append(embed(torch.tensor([[token]]))[0, 0])
                targets.append((token, trained))
        nxt = [t[0] if t is not None and t[1] else IGNORE_INDEX for t in targets[1:]] + [IGNORE_INDEX]
        rows.append(torch.stack(vectors))
        labels.append(torch.tensor(nxt))
    return rows, labels


def batch(ids_rows, masks, side="right", pad_id=0):
    length = max(len(r) for r in ids_rows)
    ids = torch.full((len(ids_rows), length), pad_id)
    loss_mask = torch.zeros(len(ids_rows), length, dtype=torch.bool)
    for b, (row, mask) in enumerate(zip(ids_rows, masks)):
        cols = slice(0, len(row)) if side == "right" else slice(length - len(row), length)
        ids[b, cols] = torch.tensor(row)
        loss_mask[b, cols] = torch.tensor(mask)
    return ids, torch.tensor([len(r) for r in ids_rows]), loss_mask


ROWS = [[1, 2, P, 3, 4, P, 5, 6], [7, P, 8, 9], [10, 11, 12]]
MASKS = [[0, 0, 0, 0, 1, 0, 1, 1], [0, 0, 1, 1], [0, 1, 1]]
AUDIO_LENS = [3, 1, 5]


def test_single_audio_lands_at_the_placeholder():
    ids = torch.tensor([[10, 11, P, 12, 13]])
    audio = torch.randn(1, 3, D)
    out = inject_audio(
        embed(ids), ids, torch.tensor([5]), audio, torch.tensor([3]), P, ids.new_tensor([[0, 0, 0, 1, 1]]).bool()
    )
    assert out["embeds"].shape == (1, 7, D)
    assert out["lens"].tolist() == [7]
    torch.testing.assert_close(out["embeds"][0, :2], embed(ids)[0, :2])
    torch.testing.assert_close(out["embeds"][0, 2:5], audio[0])
    torch.testing.assert_close(out["embeds"][0, 5:], embed(ids)[0, 3:])  # shifted by T - 1 = 2
    # the last frame predicts the first trained token after the audio; frames / prompt are never targets
    assert out["labels"].tolist() == [[-100, -100, -100, -100, 12, 13, -100]]
    assert out["audio_mask"].tolist() == [[False, False, True, True, True, False, False]]
    assert out["positions"].tolist() == [list(range(7))]
    assert out["mask"].all()


@pytest.mark.parametrize("in_side", ["right", "left"])
@pytest.mark.parametrize("out_side", ["right", "left"])
def test_batch_matches_reference(in_side, out_side):
    torch.manual_seed(0)
    ids, lens, loss_mask = batch(ROWS, MASKS, in_side)
    audio = torch.randn(3, 5, D)
    audio_lens = torch.tensor(AUDIO_LENS)
    out = inject_audio(
        embed(ids), ids, lens, audio, audio_lens, P, loss_mask, padding_side=out_side, input_padding_side=in_side
    )
    expected_rows, expected_labels = reference(ROWS, MASKS, audio, AUDIO_LENS)
    expected_lens = [len(r) for r in expected_rows]
    assert expected_lens == [10, 8, 3]
    assert out["lens"].tolist() == expected_lens
    assert out["embeds"].shape == (3, 10, D)
    for b, n in enumerate(expected_lens):
        real = slice(0, n) if out_side == "right" else slice(10 - n, 10)
        pad = slice(n, 10) if out_side == "right" else slice(0, 10 - n)
        torch.testing.assert_close(out["embeds"][b, real], expected_rows[b])
        assert out["labels"][b, real].tolist() == expected_labels[b].tolist()
        assert (out["embeds"][b, pad] == 0).all() and (out["labels"][b, pad] == IGNORE_INDEX).all()
        assert out["positions"][b, real].tolist() == list(range(n)) and (out["positions"][b, pad] == 0).all()
        assert out["mask"][b, real].all() and not out["mask"][b, pad].any()
    # audio order is row-major: row 0 (the longest) gets audios 0 and 1, row 1 gets audio 2
    torch.testing.assert_close(out["embeds"][0, 2:5], audio[0, :3])
    torch.testing.assert_close(out["embeds"][0, 7], audio[1, 0])
    offset = 0 if out_side == "right" else 10 - 8
    torch.testing.assert_close(out["embeds"][1, offset + 1 : offset + 6], audio[2])
    assert out["audio_mask"].sum().item() == sum(AUDIO_LENS)


def test_labels_never_target_audio_prompt_or_padding():
    ids, lens, loss_mask = batch(ROWS, [[1] * len(r) for r in ROWS])  # everything "trainable" in the mask
    out = inject_audio(embed(ids), ids, lens, torch.randn(3, 5, D), torch.tensor(AUDIO_LENS), P, loss_mask)
    labels = out["labels"]
    assert not (labels == P).any()  # placeholders are never targets
    targets_next_to = labels[:, :-1][out["audio_mask"][:, 1:]]
    assert (targets_next_to == IGNORE_INDEX).all()  # a position followed by an audio frame has no target
    assert labels[0].tolist() == [2, -100, -100, -100, 3, 4, -100, 5, 6, -100]
    out = inject_audio(embed(ids), ids, lens, torch.randn(3, 5, D), torch.tensor(AUDIO_LENS), P, None)
    assert (out["labels"] == IGNORE_INDEX).all()


def test_pad_multiple_rounds_up():
    ids, lens, loss_mask = batch(ROWS, MASKS)
    for multiple, expected in [(1, 10), (8, 16), (10, 10), (3, 12)]:
        for side in ("right", "left"):
            out = inject_audio(
                embed(ids),
                ids,
                lens,
                torch.randn(3, 5, D),
                torch.tensor(AUDIO_LENS),
                P,
                loss_mask,
                pad_multiple=multiple,
                padding_side=side,
                input_padding_side="right",
            )
            assert out["embeds"].shape[1] == expected and out["labels"].shape[1] == expected
            assert out["lens"].tolist() == [10, 8, 3]
            assert out["mask"].sum(1).tolist() == [10, 8, 3]
    with pytest.raises(ValueError, match="pad_multiple"):
        inject_audio(
            embed(ids), ids, lens, torch.randn(3, 5, D), torch.tensor(AUDIO_LENS), P, loss_mask, pad_multiple=0
        )


def test_gradients_reach_tokens_and_audio():
    ids, lens, loss_mask = batch(ROWS, MASKS)
    tokens = embed(ids).requires_grad_()
    audio = torch.randn(3, 5, D, requires_grad=True)
    out = inject_audio(tokens, ids, lens, audio, torch.tensor(AUDIO_LENS), P, loss_mask, pad_multiple=16)
    (out["embeds"] * torch.randn_like(out["embeds"])).sum().backward()
    frame_has_grad = audio.grad.abs().sum(-1) > 0
    assert frame_has_grad.tolist() == [[j < n for j in range(5)] for n in AUDIO_LENS]
    token_has_grad = tokens.grad.abs().sum(-1) > 0
    assert token_has_grad.tolist() == ((ids != P) & (ids != 0)).tolist()


def test_placeholder_count_mismatch_and_padding_ignored():
    ids, lens, loss_mask = batch(ROWS, MASKS)
    with pytest.raises(ValueError, match=r"3 audio placeholders.*\[2, 1, 0\].*2 audio embeddings"):
        inject_audio(embed(ids), ids, lens, torch.randn(2, 5, D), torch.tensor([3, 1]), P, loss_mask)
    # a placeholder id in the padding is not a placeholder
    ids, lens, loss_mask = batch([[1, P, 2], [3]], [[0, 0, 1], [1]], pad_id=P)
    out = inject_audio(embed(ids), ids, lens, torch.randn(1, 2, D), torch.tensor([2]), P, loss_mask)
    assert out["lens"].tolist() == [4, 1]
    with pytest.raises(ValueError, match="audio_lens"):
        inject_audio(embed(ids), ids, lens, torch.randn(1, 2, D), torch.tensor([3]), P, loss_mask)
    with pytest.raises(ValueError, match="padding_side"):
        inject_audio(embed(ids), ids, lens, torch.randn(1, 2, D), torch.tensor([2]), P, loss_mask, padding_side="up")
    with pytest.raises(ValueError, match="audio_embeds"):
        inject_audio(embed(ids), ids, lens, torch.randn(1, 2, D + 1), torch.tensor([2]), P, loss_mask)


def test_audio_positions_helper():
    ids, lens, _ = batch(ROWS, MASKS, side="left", pad_id=P)
    assert audio_positions(ids, P, lens, padding_side="left").tolist() == [[0, 2], [0, 5], [1, 5]]
    assert len(audio_positions(ids, P)) > 3  # without lengths the padding counts too


def test_zero_length_audio_and_dtype():
    ids = torch.tensor([[1, P, 2]])
    out = inject_audio(
        embed(ids).half(),
        ids,
        torch.tensor([3]),
        torch.randn(1, 4, D),
        torch.tensor([0]),
        P,
        torch.tensor([[False, False, True]]),
    )
    assert out["embeds"].dtype == torch.float16 and out["lens"].tolist() == [2]
    assert out["labels"].tolist() == [[2, -100]]
