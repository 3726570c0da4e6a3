"""An agent written against the OpenAI API, with the official `openai` SDK, that trains the policy of a
running asyncrl job through its chat endpoint.

It answers two-digit additions ("37+58=") and may call one function tool, `calculate`. Every question
is asked `--group` times, one session each: the sessions of a question form one GRPO group, and each is
closed with its reward (1 for the exact answer, else 0). Nothing here is asyncrl code: only the base
URL, the API key, a `session_id` per episode and the close call are asyncrl's.

    # the tools take ~150 tokens of the character-level model's context: a model with 256 positions
    ROOM="model.path=.cache/models/agent model.tiny.max_position=256 rollout.engine.max_model_len=256"
    asyncrl data --config configs/quickstart.yaml && asyncrl init-model --config configs/quickstart.yaml $ROOM
    export AGENT_KEY=$(openssl rand -hex 16)
    asyncrl run --config configs/quickstart.yaml $ROOM run.name=demo rollout.chat.enabled=true \\
        rollout.chat.tool_parser=hermes rollout.chat.api_key_env=AGENT_KEY &
    python examples/openai_agent.py --run-dir runs/demo --api-key-env AGENT_KEY --questions 20
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import random
import time
import uuid
from pathlib import Path

from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an integer expression with + - *.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
CHAT_FILE_WAIT_S = 600.0  # a job's endpoint is up once its engine has started (minutes on a small CPU box)


def calculate(expression: str) -> str:
    """The tool: integers with + - * (parsed, never evaluated as Python)."""
    try:
        return str(_value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError):
        return "error: only integers with + - *"


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("not an integer expression")


def ask(client: OpenAI, messages: list[dict], session_id: str) -> dict:
    """One streamed turn, assembled into the assistant message to send back next time."""
    content, calls = "", {}
    stream = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True,
                                            extra_body={"session_id": session_id})
    for chunk in stream:
        if not chunk.choices:  # a usage chunk
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            entry["id"] = call.id or entry["id"]
            entry["function"]["name"] += call.function.name or ""
            entry["function"]["arguments"] += call.function.arguments or ""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return message


def episode(client: OpenAI, question: str, answer: str, session_id: str, max_turns: int) -> float:
    """Play one session to its final answer; its reward."""
    messages = [{"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = ask(client, messages, session_id)
        messages.append(reply)
        if not reply.get("tool_calls"):
            return float(reply["content"].strip() == answer)
        for call in reply["tool_calls"]:
            try:
                expression = str(json.loads(call["function"]["arguments"]).get("expression", ""))
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calculate(expression)})
    return 0.0


def endpoint_url(run_dir: Path) -> str:
    """Server 0's endpoint, from the file it writes once it serves."""
    chat_file = run_dir / "rollout" / "server-0.chat.json"
    deadline = time.monotonic() + CHAT_FILE_WAIT_S
    while not chat_file.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{chat_file} did not appear: is the job running with rollout.chat.enabled=true?")
        time.sleep(1.0)
    return json.loads(chat_file.read_text())["url"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the endpoint's base URL, e.g. http://127.0.0.1:8000/v1")
    where.add_argument("--run-dir", type=Path, help="the job's run directory (its server 0's address is read there)")
    parser.add_argument("--api-key-file", help="file holding the endpoint's API key")
    parser.add_argument("--api-key-env", help="environment variable holding the endpoint's API key")
    parser.add_argument("--questions", type=int, default=10, help="questions to ask (one group each)")
    parser.add_argument("--group", type=int, default=4, help="sessions per question (the GRPO group)")
    parser.add_argument("--max-turns", type=int, default=3, help="model turns per session at most")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    key = "none"  # the SDK wants a key; a loopback endpoint without one ignores it
    if args.api_key_file:
        key = Path(args.api_key_file).read_text().strip()
    elif args.api_key_env:
        key = os.environ[args.api_key_env]
    client = OpenAI(base_url=args.url or endpoint_url(args.run_dir), api_key=key)
    rng = random.Random(args.seed)
    rewards = []
    for _ in range(args.questions):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        group = f"q-{uuid.uuid4().hex[:12]}"
        for member in range(args.group):
            session_id = f"{group}-{member}"
            reward = episode(client, f"{a}+{b}=", str(a + b), session_id, args.max_turns)
            rewards.append(reward)
            closed = client.post(f"/sessions/{session_id}/close", cast_to=object,
                                 body={"reward": reward, "group_id": group, "group_size": args.group})
            if closed["sent"]:
                print(f"{a}+{b}= group sent to the buffer as {closed['record_id']} (offset {closed['offset']})")
    print(f"mean reward {sum(rewards) / len(rewards):.3f} over {len(rewards)} sessions")


if __name__ == "__main__":
    main()
