"""The memory account counts distinct storages, each byte once, for the first category that covers it."""
import torch

from ascendspeed.training.memory import MemoryAccount, storage_bytes


def test_views_and_shared_storages_count_once():
    weights = torch.zeros(100, dtype=torch.bfloat16)          # 200 bytes
    buffer = torch.zeros(100, dtype=torch.int32)              # 400 bytes: [bf16 weights | remainders]
    model_view = buffer.view(torch.int16)[:100].view(torch.bfloat16)
    main_view = buffer.view(torch.float32)
    grads = torch.zeros(64, dtype=torch.float32)              # 256 bytes, two views of it
    state = [torch.zeros(10), torch.zeros(10)]                # 80 bytes
    sizes = storage_bytes([[weights, model_view, weights[10:20]], [main_view], [grads[:32], grads[32:]], state])
    assert sizes == [200 + 200, 200, 256, 80]


def test_uncovered_bytes_go_to_the_first_category_using_the_storage():
    padded = torch.zeros(128)                                 # 512 bytes, the tensors cover 400 of them
    sizes = storage_bytes([[padded[:50]], [padded[50:100]], [], []])
    assert sizes == [200 + 112, 200, 0, 0]


def test_strided_views_cover_their_extent():
    matrix = torch.zeros(4, 8)
    column = matrix[:, 1]                                     # elements 1, 9, 17, 25: bytes [4, 104)
    assert storage_bytes([[column], [matrix]]) == [100, 28]


def test_line_reports_bytes_per_parameter():
    account = MemoryAccount(parameters=1000, model_weights=2000, main_weights=2000, gradients=2000,
                            optimizer_state=8000)
    assert account.bytes_per_parameter == 14.0
    line = account.line()
    assert line.startswith("memory per rank: model weights") and line.endswith("(14.00 bytes per parameter)")


def test_nested_activation_accounts_count_what_autograd_keeps():
    from ascendspeed.training.activations import SavedTensorAccount

    weight = torch.randn(64, 64, requires_grad=True)
    outer, inner = SavedTensorAccount(excluded=[weight]), SavedTensorAccount(excluded=[weight])
    x = torch.randn(32, 64, requires_grad=True)
    with outer.recording():
        hidden = (x @ weight).tanh()        # saves x (8 KiB) and the tanh output (8 KiB); the weight is excluded
        with inner.recording():
            loss = (hidden * hidden).sum()  # saves hidden: new to inner, already kept by tanh for outer
        assert (inner.live, outer.live) == (8192, 2 * 8192)
    loss.backward()
    assert (inner.live, inner.peak, outer.live, outer.peak) == (0, 8192, 0, 2 * 8192)


def test_line_appends_the_activations_of_a_step():
    account = MemoryAccount(parameters=1000, model_weights=2000, main_weights=0, gradients=2000, optimizer_state=8000)
    assert account.line(activation_bytes=3 * 2**20).endswith(
        "(12.00 bytes per parameter); activations 3.00 MiB at the step's peak (saved for backward)")
