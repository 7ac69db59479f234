"""The parameter server's host buffers: where a GPU's tensors cross a CPU link they go through pinned
buffers kept for the run, and a buffer a GPU copy reads is written again only after waiting for it.

One worker and one server, each with a stand-in link (no process group, no other rank): the link
answers receives with chosen values and keeps what was sent. Its "GPU" is the CPU, and pinned
memory and CUDA events are stand-ins (a CPU build of torch cannot pin), so the pinned path's
logic runs here; the real copies run in the GPU tests."""

from types import SimpleNamespace

import torch
import torch.nn as nn

from labkit.strategies.ps_roles import PULL_TAG, PUSH_TAG, Link, Server, Worker


class Fence:
    def __init__(self, log: list, index: int) -> None:
        self.log, self.index = log, index
        self.recorded = False

    def record(self) -> None:
        self.recorded = True
        self.log.append(("record", self.index))

    def wait(self) -> None:
        self.recorded = False
        self.log.append(("wait", self.index))


class StandInLink(Link):
    """A CPU link carrying a pretend GPU's tensors: pinned buffers and fences are stand-ins."""

    def __init__(self, pinned: bool = True) -> None:
        self.group, self.device = None, torch.device("cpu")
        self.gpu = torch.device("cpu") if pinned else None
        self.buffers: list[torch.Tensor] = []  # every "pinned" allocation, in order
        self.fences: list[Fence] = []
        self.log: list = []
        self.sent: list = []  # (to, tag, values, data_ptr)
        self.incoming: dict = {}  # (source, tag) -> values the next receive gets
        self.arrivals: list[int] = []  # the sources recv_any answers, in order

    def allocate(self, numel, dtype):
        self.buffers.append(torch.zeros(numel, dtype=dtype))
        return self.buffers[-1]

    def fence(self):
        self.fences.append(Fence(self.log, len(self.fences)))
        return self.fences[-1]

    def send(self, tensor, to, tag):
        self.sent.append((to, tag, tensor.clone(), tensor.data_ptr()))

    def recv(self, tensor, source, tag):
        self.log.append(("recv", source))
        tensor.copy_(self.incoming[(source, tag)])

    def recv_any(self, tensor, tag):
        source = self.arrivals.pop(0)
        tensor.copy_(self.incoming[(source, tag)])
        return source

    def wait_all(self, works):
        pass


def pinned_range(link, pointer):
    """Whether ``pointer`` lies in one of the link's stand-in pinned buffers."""
    return any(buffer.data_ptr() <= pointer < buffer.data_ptr() + buffer.numel() * buffer.element_size()
               for buffer in link.buffers)


def model_with_gradients():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    return model


def test_a_worker_pushes_and_pulls_through_the_same_pinned_buffers_every_step():
    link, model = StandInLink(), model_with_gradients()
    bounds = [(0, 4), (4, 8)]  # two servers, 8 values in all (a 3x2 weight and 2 biases)
    worker = Worker(model.parameters(), bounds, link)
    assert len(link.buffers) == 2  # the pulled weights and the outgoing gradient, made once
    for step in range(3):
        pulled = torch.arange(8, dtype=torch.float32) + 10 * step
        link.incoming = {(0, PULL_TAG): pulled[:4], (1, PULL_TAG): pulled[4:]}
        link.sent.clear()
        mark = len(link.log)
        worker.update(optimizer=None)
        gradient = torch.cat([parameter.grad.reshape(-1) for parameter in model.parameters()])
        assert [(to, tag) for to, tag, _, _ in link.sent] == [(0, PUSH_TAG), (1, PUSH_TAG)]
        assert torch.equal(torch.cat([values for _, _, values, _ in link.sent]), gradient)
        assert all(pinned_range(link, pointer) for _, _, _, pointer in link.sent)
        assert torch.equal(torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()]), pulled)
        # The weights buffer (made first): waited on before the receives write it, fenced after the
        # copies to the parameters read it. The gradient's (a blocking copy) needs no fence.
        weights, outgoing = 0, 1
        assert link.log[mark:] == [("wait", outgoing), ("wait", weights), ("recv", 0), ("recv", 1), ("record", weights)]
    assert len(link.buffers) == 2


def test_over_a_link_without_a_gpu_the_worker_keeps_its_plain_buffers():
    link, model = StandInLink(pinned=False), model_with_gradients()
    worker = Worker(model.parameters(), [(0, 8)], link)
    link.incoming = {(0, PULL_TAG): torch.ones(8)}
    worker.update(optimizer=None)
    assert worker.outgoing is None and link.buffers == [] and link.fences == []
    assert all(torch.equal(parameter.detach(), torch.ones_like(parameter)) for parameter in model.parameters())


def server(link, workers, staleness=0, lr=0.5):
    config = SimpleNamespace(lr=lr, staleness=staleness)
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(1.0)
    serving = Server(0, model, [(0, 8)], 1, workers, link, config, torch.device("cpu"), {})
    optimizer = torch.optim.SGD(serving.holder.parameters(), lr=lr)
    return serving, optimizer


def test_a_synchronous_server_applies_the_mean_through_staging_and_answers_from_one_pinned_buffer():
    link = StandInLink()
    serving, optimizer = server(link, workers=2)
    shard = serving.holder.shard
    for step in range(3):
        pushes = {1: torch.full((8,), 2.0 + step), 2: torch.full((8,), 4.0 + step)}
        link.incoming = {(source, PUSH_TAG): values for source, values in pushes.items()}
        before = shard.detach().clone()
        link.sent.clear()
        serving.serve_in_step(optimizer)
        mean = (pushes[1] + pushes[2]) / 2
        assert torch.equal(shard.grad, mean)  # through the staging's buffer, values unchanged
        assert pinned_range(link, shard.grad.data_ptr())
        assert torch.equal(shard.detach(), before - 0.5 * mean)
        assert [to for to, _, _, _ in link.sent] == [1, 2]
        assert all(torch.equal(values, shard.detach()) for _, _, values, _ in link.sent)
        assert len({pointer for _, _, _, pointer in link.sent}) == 1 and pinned_range(link, link.sent[0][3])
    # Two staging slots and one answer buffer, made in the first steps and reused after.
    assert len(link.buffers) == 3 and len(serving.answers) == 1


def test_an_asynchronous_server_keeps_one_pinned_answer_per_answer_in_flight():
    link = StandInLink()
    serving, optimizer = server(link, workers=2, staleness=1)
    link.incoming = {(1, PUSH_TAG): torch.full((8,), 1.0), (2, PUSH_TAG): torch.full((8,), 3.0)}
    link.arrivals = [1, 2]
    serving.serve_as_they_come(optimizer)
    first = [(to, pointer) for to, _, _, pointer in link.sent]
    assert [to for to, _ in first] == [1, 2]
    assert len(serving.answers) == 2 and first[0][1] != first[1][1]  # two answers in flight: two buffers
    assert all(pinned_range(link, pointer) for _, pointer in first)
    # The answers hold the shard as it was when each was made, not as later pushes left it.
    assert not torch.equal(link.sent[0][2], link.sent[1][2])
    assert torch.equal(link.sent[1][2], serving.holder.shard.detach())
    link.sent.clear()
    link.arrivals = [2, 1]
    serving.serve_as_they_come(optimizer)
    assert len(serving.answers) == 2  # reused: the last iteration's sends were waited
    assert {pointer for _, _, _, pointer in link.sent} == {pointer for _, pointer in first}


def test_over_a_link_without_a_gpu_the_server_sends_its_shard_as_before():
    link = StandInLink(pinned=False)
    serving, optimizer = server(link, workers=1)
    link.incoming = {(1, PUSH_TAG): torch.ones(8)}
    serving.serve_in_step(optimizer)
    assert serving.staging is None and serving.answers == [] and link.buffers == []
    assert link.sent[0][3] == serving.holder.shard.data_ptr()  # the shard itself, no copy (as before)
