"""The built-in environment `gsm8k_python`: a GSM8K question, solved with a Python tool.

`reset(row, seed)` opens with a system message and the row's question (row {"question", "answer"}, GSM8K's own
fields; the answer's "#### N" is the reference, and a row without one is refused there). The model has one tool,
`python(code)`: the code runs in a grpo_jax.sandbox.Sandbox (`timeout_s`, `memory_mb`; one per environment,
made at the first call, closed by close()) and its stdout is the result. A program that fails (an exception, the
time or memory limit, more than MAX_OUTPUT_BYTES of output, the network) is a tool error: the model reads the
failure and the tail of stderr, and the episode goes on. The first turn without tool calls is the final answer
and ends the episode (the default step).

`reward()`: named parts {"correct", "tool_errors"}. correct is 1.0 when the final answer, read as the `gsm8k`
reward reads a completion (grpo_jax.algorithm.rewards.extract_final_answer: "#### N", then \\boxed{N}, then
"answer is N", then the last number), equals the reference, else 0.0 (also for an episode that ended without a
final answer). tool_errors is -tool_error_penalty per failed tool call (-0.0 with the default penalty 0). A
failure of the sandbox itself (SandboxError: not the program's fault; a full or missing temporary directory, a
sandbox that cannot be made or cannot start its child) reaches the model as a tool error, as every exception of a
tool does, and makes reward() raise it, so that the episode is not trained as the model's doing.
"""

from __future__ import annotations

from grpo_jax import sandbox
from grpo_jax.algorithm.rewards.answers import extract_final_answer, numbers_match, parse_reference
from grpo_jax.envs.environment import Environment, StepResult, register_environment
from grpo_jax.envs.render import AssistantTurn
from grpo_jax.envs.tools import Tool, ToolError, is_int, is_number

SYSTEM_PROMPT = ("Solve the math problem. You may run Python with the python tool: it returns what the program "
                 "prints. When you know the answer, reply without a tool call and end with '#### <number>'.")
# A program's output goes into the conversation: more than this is a failure the model reads, not context spent.
MAX_OUTPUT_BYTES = 4096
STDERR_TAIL_CHARS = 600  # of a failed program's stderr, the end: where a traceback names the error


@register_environment("gsm8k_python")
class Gsm8kPythonEnv(Environment):
    """A GSM8K question with a Python tool (module docstring)."""

    def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 512, tool_error_penalty: float = 0.0,
                 last_number_fallback: bool = True, system_prompt: str = SYSTEM_PROMPT):
        # Checked here rather than by the Sandbox, which is made at the first call: a bad kwarg fails the config.
        if not (is_number(timeout_s) and 0 < timeout_s < float("inf")):
            raise ValueError(f"gsm8k_python: timeout_s={timeout_s!r}: must be a number of seconds > 0 (how long one "
                             "program may run)")
        if not (is_int(memory_mb) and memory_mb >= sandbox.MIN_MEMORY_MB):
            raise ValueError(f"gsm8k_python: memory_mb={memory_mb!r}: must be an integer >= {sandbox.MIN_MEMORY_MB} "
                             "(MB of address space per program)")
        if not (is_number(tool_error_penalty) and 0 <= tool_error_penalty < float("inf")):
            raise ValueError(f"gsm8k_python: tool_error_penalty={tool_error_penalty!r}: must be a number >= 0 (the "
                             "reward taken off per failed tool call; 0 for none)")
        if not isinstance(last_number_fallback, bool):
            raise ValueError(f"gsm8k_python: last_number_fallback={last_number_fallback!r}: True or False (whether "
                             "a final answer without '#### N' is read as its last number)")
        if not isinstance(system_prompt, str) or not system_prompt:
            raise ValueError(f"gsm8k_python: system_prompt={system_prompt!r}: a non-empty str")
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.tool_error_penalty, self.last_number_fallback = float(tool_error_penalty), last_number_fallback
        self.system_prompt = system_prompt
        self.tools = [Tool.from_function(self.python)]
        self.sandbox: sandbox.Sandbox | None = None
        self.sandbox_error: sandbox.SandboxError | None = None
        self.reference = None
        self.final_answer: str | None = None  # the content of the turn without tool calls, once there is one
        self.tool_errors = 0

    def python(self, code: str) -> str:
        """Run a Python program (the standard library only) and return what it prints.

        Args:
            code: The program's source. Print the values you need: only stdout comes back.
        """
        try:
            if self.sandbox is None:
                self.sandbox = sandbox.Sandbox(timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                               max_output_bytes=MAX_OUTPUT_BYTES, workers=1)
            result = self.sandbox.run_python(code)
        except sandbox.SandboxError as e:
            self.sandbox_error = e
            raise
        if not result.ok:
            tail = result.stderr.strip()[-STDERR_TAIL_CHARS:]
            raise ToolError(f"the program failed ({result.failure}, exit code {result.exit_code})"
                            + (f"; stderr ends with:\n{tail}" if tail else ""))
        return result.stdout

    async def reset(self, row: dict, seed: int) -> list[dict]:
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not question:
            raise ValueError(f"gsm8k_python: row['question']={question!r}: the question, a non-empty str")
        self.reference = parse_reference(str(answer)) if answer is not None else None
        if self.reference is None:
            raise ValueError(f"gsm8k_python: row['answer']={answer!r}: holds no reference number; GSM8K's answers "
                             "end with '#### N'")
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]

    async def step(self, turn: AssistantTurn) -> StepResult:
        result = await super().step(turn)
        self.tool_errors += result.tool_errors
        if result.done:
            self.final_answer = turn.content
        return result

    async def reward(self) -> dict[str, float]:
        if self.sandbox_error is not None:
            raise self.sandbox_error
        got = None if self.final_answer is None else extract_final_answer(self.final_answer,
                                                                           self.last_number_fallback)
        correct = got is not None and numbers_match(got, self.reference)
        return {"correct": float(correct), "tool_errors": -self.tool_error_penalty * self.tool_errors}

    async def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
