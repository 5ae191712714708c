"""Agents for the Ray gateway tests (test_ray_gateway.py): they run on the rollout actors, so they talk to the
test through files."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

_episodes = itertools.count()  # in the actor's process: episodes started there, in order


class WaitsInItsSecondStep:
    """The calculator loop; the episodes of the second step (numbers per_step..2·per_step-1) each make their
    first call, say so (`called`), and wait for `go` before their second: the test lands new weights there."""

    def __init__(self, folder: str, per_step: int):
        self.folder, self.per_step = Path(folder), per_step

    def __call__(self, client, row: dict):
        from tests.gateway_agents import TOOLS, opening, run_tools

        k = next(_episodes)
        messages = opening(row)
        for turn in range(4):
            reply = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=48
            )
            message = reply.choices[0].message
            if turn == 0 and self.per_step <= k < 2 * self.per_step:
                (self.folder / f"called-{k}").touch()
                deadline = time.monotonic() + 120
                while not (self.folder / "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            messages.append(message)
            if reply.choices[0].finish_reason != "tool_calls":
                return None
            run_tools(messages, message.tool_calls)
        return None


def hanging_command() -> None:
    """`--agent-command "python tests/integration/ray_agents.py FOLDER"`: one model call, then it hangs; it
    leaves its pid and session URL in FOLDER for the test to check that nothing is left behind."""
    import urllib.request

    folder = Path(sys.argv[1])
    row = json.load(sys.stdin)
    url, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    (folder / f"agent-{os.getpid()}").write_text(url)
    messages = [{"role": "user", "content": str(row["prompt"])}]
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": 8}).encode()
    request = urllib.request.Request(
        f"{url}/chat/completions",
        body,
        {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=120).read()
    time.sleep(600)


if __name__ == "__main__":
    hanging_command()
