"""What the serving benchmarks feed tierlm's batcher: a tokenizer that decodes nothing (the tokens
are timed, not read) and a deterministic prompt of n token ids."""


class NullTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def prompt(n: int) -> list[int]:
    return [(7 * i) % 200 + 3 for i in range(n)]
