"""A tiny network agent for the lab's own tests, run by path (standard library only, so it starts in milliseconds).

    python agent.py serve OUT                  TCP echo (or sink) and UDP recorder on free ports; writes
                                               "PORTS tcp udp" to stdout, each UDP payload as a line to OUT
    python agent.py reach TIMEOUT ADDR:PORT...  which TCP addresses answer an echo within TIMEOUT: JSON {addr: ok}
    python agent.py udp ADDR:PORT PAYLOAD       send one datagram
    python agent.py send ADDR:PORT BYTES        stream BYTES to the sink; JSON {"seconds", "bytes"}
    python agent.py echo ADDR:PORT TIMEOUT      one echo's round trip: JSON {"seconds"} or {"error"}
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time


def _serve_tcp(conn: socket.socket) -> None:
    with conn:
        first = conn.recv(1)
        if first == b"S":  # sink: count until EOF, answer the count
            n = 0
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    break
                n += len(data)
            conn.sendall(str(n).encode())
            return
        data = first
        while data:
            conn.sendall(data)
            data = conn.recv(65536)


def serve(out: str) -> None:
    tcp = socket.socket()
    tcp.bind(("0.0.0.0", 0))
    tcp.listen(64)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))
    print(f"PORTS {tcp.getsockname()[1]} {udp.getsockname()[1]}", flush=True)

    def udp_loop() -> None:
        while True:
            data, _ = udp.recvfrom(65536)
            with open(out, "a") as f:
                f.write(data.decode() + "\n")

    threading.Thread(target=udp_loop, daemon=True).start()
    while True:
        conn, _ = tcp.accept()
        threading.Thread(target=_serve_tcp, args=(conn,), daemon=True).start()


def _echo(target: str, timeout: float) -> dict:
    host, port = target.rsplit(":", 1)
    t = time.perf_counter()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as c:
            c.sendall(b"ping")
            got = b""
            while len(got) < 4:
                chunk = c.recv(4 - len(got))
                if not chunk:
                    raise ConnectionError("closed")
                got += chunk
        return {"seconds": time.perf_counter() - t}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> int:
    cmd = sys.argv[1]
    if cmd == "serve":
        serve(sys.argv[2])
    elif cmd == "reach":
        timeout = float(sys.argv[2])
        results: dict[str, bool] = {}
        threads = [threading.Thread(target=lambda t=t: results.__setitem__(t, "seconds" in _echo(t, timeout)))
                   for t in sys.argv[3:]]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        print(json.dumps(results))
    elif cmd == "udp":
        host, port = sys.argv[2].rsplit(":", 1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(3):  # three copies: one is enough to arrive
                s.sendto(sys.argv[3].encode(), (host, int(port)))
    elif cmd == "send":
        host, port = sys.argv[2].rsplit(":", 1)
        total = int(sys.argv[3])
        block = b"\0" * (1 << 18)
        t = time.perf_counter()
        with socket.create_connection((host, int(port)), timeout=60) as c:
            c.sendall(b"S")
            sent = 0
            while sent < total:
                n = min(len(block), total - sent)
                c.sendall(block[:n])
                sent += n
            c.shutdown(socket.SHUT_WR)
            got = int(c.recv(64))
        print(json.dumps({"seconds": time.perf_counter() - t, "bytes": got}))
    elif cmd == "echo":
        print(json.dumps(_echo(sys.argv[2], float(sys.argv[3]))))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
