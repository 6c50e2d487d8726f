"""What a Pod on the test node needs from the host that a real cluster's add-ons would give it.

The apiserver of the test cluster listens on 127.0.0.1 only and there is no CoreDNS image (no registry), so
`make e2e` (tests/e2e/run.py) runs two small host-side services on the Pod bridge's gateway address:

- `ApiRelay`: a TCP relay from <bridge>:<port> to the apiserver on 127.0.0.1. The `kubernetes` Service's
  Endpoints name it (the test cluster runs without the endpoint reconciler), so in-cluster clients (the
  gateway's pod discovery, the profiling Job's ConfigMap write) reach the apiserver through
  https://10.0.0.1:443 and kube-proxy, and verify its certificate (it names 10.0.0.1) as on any cluster.
- `ClusterDns`: a UDP DNS responder for `<service>.<namespace>.svc.cluster.local` A records, read from the
  API on every query (the ClusterIP, or the ready endpoint addresses of a headless Service), as CoreDNS's
  kubernetes plugin answers; NXDOMAIN for anything else. The kubelet points Pods at it (clusterDNS), with
  the usual search path, so `redis://x-redis:6379` and `http://x-router:8000` resolve.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import struct
import threading
from collections.abc import Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

CLUSTER_SUFFIX = ".svc.cluster.local"


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (sink, source):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


class _Served:
    """A socketserver run on a daemon thread (its handlers on theirs), started and stopped by the test."""

    def __init__(self, server: socketserver.BaseServer) -> None:
        server.daemon_threads = True  # type: ignore[attr-defined]
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ApiRelay(_Served):
    """Relays TCP connections from (host, any free port) to 127.0.0.1:`target_port`."""

    def __init__(self, host: str, target_port: int) -> None:
        target = ("127.0.0.1", target_port)

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    upstream = socket.create_connection(target, timeout=10)
                except OSError:
                    return
                upstream.settimeout(None)
                back = threading.Thread(target=_pump, args=(upstream, self.request), daemon=True)
                back.start()
                _pump(self.request, upstream)
                back.join()
                upstream.close()

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        super().__init__(socketserver.ThreadingTCPServer((host, 0), Handler))
        self.port = int(self.server.server_address[1])


def parse_query(packet: bytes) -> tuple[int, int, str, int, int]:
    """(id, flags, lower-case name without the final dot, qtype, end of the question) of a DNS query."""
    ident, flags = struct.unpack("!HH", packet[:4])
    labels, offset = [], 12
    while packet[offset]:
        length = packet[offset]
        labels.append(packet[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
        offset += 1 + length
    qtype = struct.unpack("!H", packet[offset + 1 : offset + 3])[0]
    return ident, flags, ".".join(labels).lower(), qtype, offset + 5


def answer(packet: bytes, addresses: list[str] | None) -> bytes:
    """The reply to `packet`: A records for `addresses`, NOERROR without records for another type of a
    known name, NXDOMAIN (`addresses` None) for an unknown one."""
    ident, flags, _, qtype, end = parse_query(packet)
    records = list(addresses or []) if qtype == 1 else []
    rcode = 3 if addresses is None else 0
    header = struct.pack("!HHHHHH", ident, 0x8000 | (flags & 0x0100) | 0x0080 | rcode, 1, len(records), 0, 0)
    body = packet[12:end]
    for address in records:
        body += struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(address)
    return header + body


def service_addresses(core: client.CoreV1Api) -> Callable[[str], list[str] | None]:
    """A resolver of `<service>.<namespace>.svc.cluster.local` against the API."""

    def resolve(name: str) -> list[str] | None:
        if not name.endswith(CLUSTER_SUFFIX):
            return None
        parts = name[: -len(CLUSTER_SUFFIX)].split(".")
        if len(parts) != 2:
            return None
        service, namespace = parts
        try:
            found = core.read_namespaced_service(service, namespace)
        except ApiException:
            return None
        if found.spec.cluster_ip and found.spec.cluster_ip != "None":
            return [found.spec.cluster_ip]
        try:
            endpoints = core.read_namespaced_endpoints(service, namespace)
        except ApiException:
            return []
        return [a.ip for subset in endpoints.subsets or [] for a in subset.addresses or []]

    return resolve


class ClusterDns(_Served):
    """A UDP DNS responder on (host, 53) answering with `resolve`."""

    def __init__(self, host: str, resolve: Callable[[str], list[str] | None]) -> None:
        self.queries: list[str] = []
        queries = self.queries

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                packet, sock = self.request
                try:
                    name = parse_query(packet)[2]
                    queries.append(name)
                    reply = answer(packet, resolve(name))
                except (IndexError, struct.error, UnicodeError):
                    return
                sock.sendto(reply, self.client_address)

        socketserver.ThreadingUDPServer.allow_reuse_address = True
        super().__init__(socketserver.ThreadingUDPServer((host, 53), Handler))
