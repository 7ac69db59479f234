"""Which address and interface a process uses to reach the lab: loopback on one machine, a NIC past it.

The lab has one address everything is measured from: the controller's. A rank
(on this machine or another) finds the interface whose address the kernel would
use to reach it; gloo and nccl open their sockets there and rank 0 serves the
rendezvous store there. So one setting (``controller_address``) places a lab on
one machine or across several, and ``interface`` overrides the choice per lab.

Pure standard library plus psutil; runs in the notebook and in the ranks.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

from labkit.spec.errors import LabConfigError

LOOPBACK_ADDRESS = "127.0.0.1"


class NetworkError(LabConfigError):
    """An address or interface that this machine does not have."""


def ipv4_addresses() -> dict[str, list[str]]:
    """Interface name -> its IPv4 addresses."""
    found: dict[str, list[str]] = {}
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family == socket.AF_INET:
                found.setdefault(name, []).append(entry.address)
    return found


def _listing() -> str:
    return ", ".join(f"{name} {' '.join(addresses)}" for name, addresses in sorted(ipv4_addresses().items()))


def check_ipv4(address, what: str) -> str:
    if not isinstance(address, str):
        raise NetworkError(f"{what} is an IPv4 address such as '10.0.0.5', got {address!r}")
    try:
        return str(ipaddress.IPv4Address(address.strip()))
    except ValueError:
        raise NetworkError(f"{what} is an IPv4 address such as '10.0.0.5', got {address!r}") from None


def interface_of(address: str) -> str:
    """The interface that holds ``address`` on this machine."""
    if ipaddress.IPv4Address(address).is_loopback:
        addresses = ipv4_addresses()
        return next((name for name, held in addresses.items() if any(a.startswith("127.") for a in held)), "lo")
    for name, held in ipv4_addresses().items():
        if address in held:
            return name
    raise NetworkError(f"{address} is not an address of this machine (it has: {_listing()})")


def address_of(interface: str) -> str:
    """The first IPv4 address of ``interface`` on this machine."""
    if not isinstance(interface, str) or not interface:
        raise NetworkError(f"interface is a network interface name such as 'eth0', got {interface!r}")
    held = ipv4_addresses().get(interface)
    if not held:
        raise NetworkError(f"this machine has no IPv4 interface {interface!r} (it has: {_listing()})")
    return held[0]


def source_address(destination: str) -> str:
    """The local address the kernel picks to reach ``destination`` (no packet is sent)."""
    if ipaddress.IPv4Address(destination).is_loopback:
        return LOOPBACK_ADDRESS
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((destination, 9))  # a UDP "connect" only chooses the route
        return probe.getsockname()[0]
    except OSError as error:
        raise NetworkError(f"this machine has no route to {destination} ({error})") from None
    finally:
        probe.close()


def place_on_network(controller_address: str, interface: str | None = None) -> tuple[str, str]:
    """(interface, address) this process uses for the lab's traffic: ``interface`` when given, else
    the one that reaches the controller."""
    if interface:
        return interface, address_of(interface)
    address = source_address(controller_address)
    return interface_of(address), address
