"""The notebook path in a real Jupyter kernel: live output and the interrupt button."""

import time

import pytest
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def kernel():
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        run(client, "%load_ext labkit\n%lab start 2 --backend gloo --threads 1 --timeout 60")
        yield manager, client
        run(client, "%lab stop")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def run(client, code, timeout=120):
    """Execute ``code``; return (reply content, [(seconds since send, iopub message)])."""
    messages = []
    began = time.monotonic()
    reply = client.execute_interactive(
        code, timeout=timeout, output_hook=lambda msg: messages.append((time.monotonic() - began, msg))
    )
    return reply["content"], messages


def test_rank_output_streams_live_then_lands_in_rank_order(kernel):
    _, client = kernel
    code = "%%lab\nimport time\nprint('first', rank, flush=True)\ntime.sleep(3)\nprint('second', rank)"
    reply, messages = run(client, code)
    assert reply["status"] == "ok"
    finished = max(at for at, _ in messages)
    live = [
        at
        for at, msg in messages
        if msg["msg_type"] == "update_display_data" and "[rank 0] first 0" in msg["content"]["data"]["text/plain"]
    ]
    assert live and live[0] < finished - 1.5, "the first line showed up while the ranks were still sleeping"
    streams = "".join(msg["content"]["text"] for _, msg in messages if msg["msg_type"] == "stream")
    assert streams == "[rank 0] first 0\n[rank 0] second 0\n[rank 1] first 1\n[rank 1] second 1\n"
    final_display = [msg for _, msg in messages if msg["msg_type"] == "update_display_data"][-1]
    assert final_display["content"]["data"]["text/plain"] == ""  # the live view is emptied at the end


def test_interrupt_button_stops_the_ranks(kernel):
    manager, client = kernel
    msg_id = client.execute("%%lab\nimport time\ntime.sleep(600)")
    time.sleep(2)
    began = time.monotonic()
    manager.interrupt_kernel()
    reply = client.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert time.monotonic() - began < 15
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "RankInterrupted"
    assert "ranks 0, 1 interrupted" in reply["content"]["evalue"]
    after, messages = run(client, "%%lab\nx = torch.ones(1)\ndist.all_reduce(x)\nprint(x.item())")
    assert after["status"] == "ok"
    assert "[ranks 0-1] 2.0" in "".join(m["content"].get("text", "") for _, m in messages)  # alike: shown once
