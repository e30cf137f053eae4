"""Hosts of the test's own on one machine: Linux network namespaces joined by veth pairs to a bridge
(iproute2's ``ip netns`` and ``ip link``; needs root, which CI has).

``Network.create()`` makes a bridge with the first address of a /24 chosen free; ``network.host(name)``
a namespace with the next address, its veth's other end on the bridge. A process started with
``host.command([...])`` has that host's network only (its own loopback, its one interface), so what it
reaches of the other hosts crosses a real (virtual) link: taking the link down (:meth:`Host.cut`) is a
partition, SIGKILLing the processes a lost machine. Everything is removed by ``network.remove()``.
Interface names stay under Linux's 15 characters.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field


# Every host's interface. The namespaces share the machine's hostname (and /etc/hosts, where it is a
# loopback address), so a library that finds its address from the hostname (gloo) must be told the
# interface instead: GLOO_SOCKET_IFNAME=eth0, as in a pod, where eth0 is the pod's address.
IFACE = "eth0"


class Unavailable(RuntimeError):
    pass


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(("netns", "exec", netns, "ip") if netns else ()), *args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise Unavailable(f"{' '.join(cmd)}: {result.stderr.strip() or result.returncode}")
    return result


def why_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


@dataclass
class Host:
    name: str
    address: str
    outer: str  # the veth end on the bridge

    def command(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def cut(self) -> None:
        """The host's link down: nothing crosses to or from it (a partition)."""
        _ip("link", "set", self.outer, "down")

    def mend(self) -> None:
        _ip("link", "set", self.outer, "up")


@dataclass
class Network:
    bridge: str
    prefix: str  # "10.a.b"
    tag: str
    hosts: list[Host] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        """The machine's own address on the network (where the Ray head and memfit's API listen)."""
        return f"{self.prefix}.1"

    @classmethod
    def create(cls) -> "Network":
        problem = why_unavailable()
        if problem:
            raise Unavailable(problem)
        used = _ip("-4", "addr").stdout
        for _ in range(50):
            prefix = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250) + 1}"
            if f" {prefix}." not in used:
                break
        tag = secrets.token_hex(3)
        net = cls(bridge=f"mfbr{tag}", prefix=prefix, tag=tag)
        _ip("link", "add", net.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
        except Unavailable:
            net.remove()
            raise
        return net

    def host(self) -> Host:
        i = len(self.hosts) + 2
        name, outer, inner = f"mfns{self.tag}{i}", f"mfvh{self.tag}{i}", f"mfvn{self.tag}{i}"
        host = Host(name=name, address=f"{self.prefix}.{i}", outer=outer)
        self.hosts.append(host)
        _ip("netns", "add", name)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", name)
        _ip("link", "set", inner, "name", IFACE, netns=name)  # every host's interface is eth0, as a pod's is
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("addr", "add", f"{host.address}/24", "dev", IFACE, netns=name)
        _ip("link", "set", IFACE, "up", netns=name)
        _ip("link", "set", "lo", "up", netns=name)
        _ip("route", "add", "default", "via", self.gateway, netns=name)
        return host

    def remove(self) -> None:
        for host in self.hosts:
            _ip("netns", "del", host.name, check=False)  # its veth pair goes with it
            _ip("link", "del", host.outer, check=False)
        _ip("link", "del", self.bridge, check=False)
