"""free_port picks outside the kernel's ephemeral range, where outgoing connections and binds to port 0 land."""
import socket

from pat_workers import ports


def test_a_free_port_is_bindable_and_outside_the_ephemeral_range():
    low, high = ports._ephemeral_range()
    picked = {ports.free_port() for _ in range(50)}
    assert all(not low <= p <= high and p >= ports._LOWEST for p in picked)
    assert len(picked) > 40  # random, not one port handed to every caller
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked.pop()))


def test_the_kernel_hands_out_ports_from_the_range_free_port_avoids():
    # The negative control: a port from bind(0), the old way, is exactly what another bind(0) may be handed next.
    low, high = ports._ephemeral_range()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert low <= s.getsockname()[1] <= high
