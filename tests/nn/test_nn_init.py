import torch

from speechtrain.nn.init import seeded


def test_seeded_builds_on_the_cpu_under_an_accelerator_context_and_leaves_the_global_stream_alone():
    """Lightning builds configure_model under the GPU's device context; the weights must still come from the CPU
    stream of the seed (the same on any machine), and no tensor may land on the accelerator."""
    with seeded(3):
        reference = torch.nn.Linear(4, 5)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    with torch.device("cuda"), seeded(3):  # no CUDA needed: nothing is made outside seeded's own CPU context
        layer = torch.nn.Linear(4, 5)
        inside = torch.empty(2).device
    assert layer.weight.device.type == "cpu" and inside.type == "cpu"
    torch.testing.assert_close(layer.weight, reference.weight, rtol=0, atol=0)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_seeded_keeps_the_meta_device_for_shape_only_builds():
    with torch.device("meta"), seeded(3):
        layer = torch.nn.Linear(4, 5)
    assert layer.weight.is_meta
