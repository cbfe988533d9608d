"""What the probes that price an Envoy feature share (`bench.difficulty.luaprice`,
`bench.difficulty.sharerun`, `bench.regions.logprice`, `bench.controlplane.scale`): a stub
upstream that answers every request at once, and a process's CPU time.

The upstream is a separate Python process so that its work is not counted as Envoy's, and
answers at once so that Envoy's own work is most of a request's time.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

STUB_UPSTREAM = r"""
import asyncio, sys
BODY = b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'
CHUNK = b'data: {"id":"x","model":"m","choices":[{"delta":{"content":"ok"}}]}\n\n'
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length)
            if b'"stream": true' in body:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                for piece in (CHUNK, CHUNK, b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""
"""The upstream's program (``python -c STUB_UPSTREAM PORT``): a chat completion, or a
stream of two chunks when the body asks for one, on keep-alive connections."""


@contextlib.contextmanager
def stub_upstream(port: int) -> Iterator[subprocess.Popen[bytes]]:
    """The stub upstream on ``127.0.0.1:port`` while the block runs."""
    process = subprocess.Popen(
        [sys.executable, "-c", STUB_UPSTREAM, str(port)], stdout=subprocess.DEVNULL
    )
    try:
        yield process
    finally:
        process.terminate()
        process.wait(10)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, seconds (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
