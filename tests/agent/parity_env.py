"""A user environment for the trainer tests, written as a user would in their own package: answer "even" or "odd"
for a number; a wrong answer gets the other word back as a hint and one more turn. Every word it writes is in
the built-in tokenizer's vocabulary."""
from verl_ds.agent import Environment, Step


class ParityHint(Environment):
    def __init__(self, wrong_reward: float = 0.0):
        super().__init__()
        self.wrong_reward = wrong_reward
        self.target = None

    def reset(self, sample):
        self.target = "even" if int(sample["number"]) % 2 == 0 else "odd"
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, turn):
        if self.target in turn.split():
            return Step([], reward=1.0, done=True)
        return Step([{"role": "user", "content": self.target}], reward=self.wrong_reward)


class FlakyParityHint(ParityHint):
    """ParityHint whose reset raises for numbers 0 mod 4, returns garbage for 1 mod 4 and hangs for 2 mod 4 (past
    agent.step_timeout_s): each ends its own trajectory, the run goes on."""

    def reset(self, sample):
        kind = int(sample["number"]) % 4
        if kind == 0:
            raise RuntimeError("the environment's backend is down")
        if kind == 1:
            return {"not": "messages"}
        if kind == 2:
            import time

            time.sleep(5)
        return super().reset(sample)


def rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows {"prompt", "number"}: the prompt asks for the number's parity in vocabulary words."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        number = rng.randrange(10, 1000)
        out.append({"prompt": f"{number} ?", "number": number})
    return out
