"""Large request bodies don't stall the cluster: 16 concurrent ~0.9 MB prompts at the entry, three times during one
stream, are answered (400, too long for the context) while the stream goes on with every gap under the membership's
detection time, and no node drops another (no membership flap, no replay)."""

import json
import random
import string
from concurrent.futures import ThreadPoolExecutor

from tests.cluster.test_replay import PROMPT
from tests.support.cluster import Cluster
from tests.support.http import post, stream_completion
from tests.support.models import FIXTURES

FLOODS_AT = (5, 25, 45)  # stream events after which 16 bodies arrive at once
DETECTION_S = 2 * (1.0 + 1.0)  # Membership's defaults: misses x (interval + check_timeout)


def big_body() -> dict:
    rng = random.Random(0)
    text = " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(150_000))
    return {"model": "llama", "messages": [{"role": "user", "content": text[:900_000]}], "max_tokens": 4}


def test_sixteen_large_bodies_while_a_stream_runs_stall_nothing():
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 200, "temperature": 0}
    with Cluster(FIXTURES / "llama", 2, memory_gb=[2, 2]) as c:
        url = f"{c.nodes[0].api_url}/v1/completions"
        reference = "".join(e.text for e in stream_completion(url, body))
        flood = big_body()
        with ThreadPoolExecutor(16) as pool:
            events, answers = [], []
            for event in stream_completion(url, body):
                events.append(event)
                if len(events) in FLOODS_AT:
                    answers += [
                        pool.submit(post, c.nodes[0].api_url, "/v1/chat/completions", flood, timeout=60)
                        for _ in range(16)
                    ]
            statuses = [(a.result()[0], json.loads(a.result()[2])["error"]["code"]) for a in answers]
        assert statuses == [(400, "context_length_exceeded")] * 16 * len(FLOODS_AT)
        assert "".join(e.text for e in events) == reference and not [e for e in events if e.error]
        gaps = [b.at - a.at for a, b in zip(events, events[1:])]
        status = {n: info["status"] for n, info in c.self_info().items()}
        assert status["node0"].get("replays", 0) == 0
        assert all(s.get("peers_left", 0) == 0 for s in status.values()), "a node dropped its peer"
        assert max(gaps) < DETECTION_S, f"the stream stalled {max(gaps):.1f}s"
