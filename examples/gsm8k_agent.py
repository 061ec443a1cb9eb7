"""An agent written only against the `openai` client, as a user's would be: it asks a GSM8K question, asks
again for the answer line when the reply has none, and scores the final reply itself. grpo_jax trains the model
behind the client on the calls it makes (configs/smollm2_gsm8k_agent_cpu.yaml):

    PYTHONPATH=examples grpo-jax train configs/smollm2_gsm8k_agent_cpu.yaml data.path=../shared/data/gsm8k

Nothing here imports grpo_jax: `client` is an `openai.AsyncOpenAI` pointed at the episode's own endpoint.
"""

import re

ANSWER_LINE = re.compile(r"^####\s*(-?[\d,]*\.?\d+)\s*$", re.MULTILINE)
INSTRUCTION = "Give the final answer on its own line as '#### <number>'."


def final_number(text: str) -> str | None:
    """The number of the reply's last '#### <number>' line, without thousands separators."""
    found = ANSWER_LINE.findall(text or "")
    return found[-1].replace(",", "") if found else None


def same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return False


async def run(row: dict, client) -> dict[str, float]:
    messages = [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=160)
    text = reply.choices[0].message.content or ""
    if final_number(text) is None:  # one more turn: the agent asks for the answer line it needs
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": INSTRUCTION}]
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=32)
        text = reply.choices[0].message.content or ""
    answer, expected = final_number(text), row["answer"].rpartition("####")[2].strip().replace(",", "")
    return {"format": float(answer is not None),
            "correct": float(answer is not None and same_number(answer, expected))}
