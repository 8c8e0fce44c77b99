import torch

from speechtrain.nn.init import seeded


def test_seeded_builds_on_the_cpu_whatever_the_device_context_and_leaves_the_global_stream_alone():
    """Lightning builds configure_model under the GPU's device context; the weights must still come from the CPU
    stream of the seed (the same on any machine). The meta device stands in for the GPU here."""
    with seeded(3):
        reference = torch.nn.Linear(4, 5)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    with torch.device("meta"), seeded(3):
        layer = torch.nn.Linear(4, 5)
        inside = torch.empty(2).device
    assert layer.weight.device.type == "cpu" and inside.type == "cpu"
    torch.testing.assert_close(layer.weight, reference.weight, rtol=0, atol=0)
    assert torch.equal(torch.random.get_rng_state(), before)
