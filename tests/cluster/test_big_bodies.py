"""Large request bodies don't stall the cluster: 16 concurrent ~0.9 MB prompts at the entry, three times during one
stream, are answered (400, too long for the context) while the stream goes on with every gap under the membership's
detection time, and no node drops another (no membership flap, no replay)."""

import json
import random
import signal
import string
import time
from concurrent.futures import ThreadPoolExecutor

from tests.cluster.test_replay import PROMPT
from tests.support.cluster import Cluster
from tests.support.http import post, stream_completion
from tests.support.models import FIXTURES

FLOODS_AT = (5, 25, 45)  # stream events after which 16 bodies arrive at once
DETECTION_S = 2 * (1.0 + 1.0)  # Membership's defaults: misses x (interval + check_timeout)
FREEZES_AT = (
    5,
    40,
)  # stream events after which the entry's process is stopped past DETECTION_S (the second after a replay)


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


def test_an_entry_frozen_past_the_detection_time_replays_its_stream_at_once_not_after_an_idle_timeout(capsys):
    """The probe's 61 s gap, reproduced without the bodies: the last node counts the frozen entry as gone and
    closes its channel with a token in flight, and the failure notices it sends the entry die on the same closing
    stream; once the entry runs again it must replay the request at once (the text unchanged), not wait for its
    own idle timeout (60 s) to fail it (node/runtime/loop_stall.py). A freeze just after the client got a token
    finds the last node's next one in flight (the entry hands a token on once the pass it feeds has ended:
    node/runtime/token_hold.py), so each freeze may cost one replay: the entry may replay as often as it is frozen,
    and no more."""
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 100, "temperature": 0}
    replays_allowed = ["--max-replays", str(len(FREEZES_AT))]
    with Cluster(FIXTURES / "llama", 2, memory_gb=[2, 2], extra=replays_allowed) as c:
        url = f"{c.nodes[0].api_url}/v1/completions"
        reference = "".join(e.text for e in stream_completion(url, body))
        events, freeze_s = [], DETECTION_S + 2
        for event in stream_completion(url, body, timeout=120):
            events.append(event)
            if len(events) in FREEZES_AT:
                c.nodes[0].proc.send_signal(signal.SIGSTOP)
                time.sleep(freeze_s)
                c.nodes[0].proc.send_signal(signal.SIGCONT)
        gaps = [b.at - a.at for a, b in zip(events, events[1:])]
        replays = c.self_info()["node0"]["status"].get("replays", 0)
        with capsys.disabled():
            print(f"\nentry frozen {len(FREEZES_AT)}x {freeze_s:.1f}s: longest gap {max(gaps):.1f}s, {replays} replays")
        assert "".join(e.text for e in events) == reference and not [e for e in events if e.error]
        assert max(gaps) < freeze_s + DETECTION_S, f"the stream waited {max(gaps):.1f}s after a {freeze_s:.1f}s freeze"
        assert replays <= len(FREEZES_AT)
