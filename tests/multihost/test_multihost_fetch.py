"""Download once across real hosts: three network namespaces on a private bridge, a cluster key, UDP discovery; only
host0 has the model. The other two find it, fetch their own layers from it over mutual TLS under its signed
manifest (which each keeps beside its copy), and the cluster answers exactly as one process holding the model."""

import json
import subprocess
import sys
import threading
import time

import pytest

from node.fetch.layout import build_manifest
from node.fetch.local_copy import MANIFEST
from node.fetch.manifest import Manifest
from node.fetch.seal import ManifestSeal
from node.security import read_key_file, write_key_file
from shards.model.shard import Shard
from tests.cluster.test_fetch_cluster import MARGIN
from tests.multihost.test_multihost import call
from tests.support import netns
from tests.support.cluster import READY_API, ROOT, reference
from tests.support.models import FIXTURES
from tests.support.polling import wait_until

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=netns.available() or "")
MODEL = FIXTURES / "llama"


def test_two_hosts_without_the_model_fetch_their_layers_from_the_third(tmp_path, capsys):
    key = tmp_path / "cluster.key"
    write_key_file(key)
    with netns.PrivateLan(3, subnet=79) as lan:
        procs = []
        started = time.monotonic()
        for i in range(3):
            model = [str(MODEL)] if i == 0 else ["llama", "--models-dir", str(tmp_path / f"host{i}")]
            procs.append(
                subprocess.Popen(
                    lan.exec(
                        i,
                        sys.executable,
                        "-m",
                        "node.cli",
                        "--model",
                        *model,
                        "--node-id",
                        f"host{i}",
                        "--engine",
                        "numpy",
                        "--cluster-key-file",
                        str(key),
                        "--memory-gb",
                        "1",
                        "--speed",
                        "1",  # the hosts share this machine's cores: equal
                    ),
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        try:
            for p in procs:
                for line in p.stdout:
                    if READY_API.search(line):
                        break
                threading.Thread(target=p.stdout.read, daemon=True).start()  # keep the pipe drained

            def plans():
                return [call(lan, i, "/v1/topology")["plan"] or [] for i in range(3)]

            wait_until(
                lambda: len((p := plans())[0]) == 3 and all(x == p[0] for x in p),
                60,
                "all hosts to agree on a three-host plan",
                interval=0.2,
            )
            ready = time.monotonic() - started
            prompt = "The capital of France is"
            body = {
                "model": "llama",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 16,
                "temperature": 0,
            }
            for i in range(3):
                assert (
                    call(lan, i, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
                    == reference(prompt, 16)[0]
                )
            manifest = build_manifest(MODEL, "llama", 6)
            topology = call(lan, 0, "/v1/topology")
            fetched = {}
            for step in topology["plan"]:
                if step["node_id"] != "host0":
                    info = call(lan, int(step["node_id"][-1]), "/v1/topology")["nodes"][0]
                    expected = manifest.nbytes(manifest.needed(Shard("llama", step["start"], step["end"], 6)))
                    received = info["status"]["fetch_bytes_received"]
                    assert expected <= received <= expected * (1 + MARGIN)
                    fetched[step["node_id"]] = received
            assert set(fetched) == {"host1", "host2"}
            seal = ManifestSeal(read_key_file(key).manifest_key(), "checker")
            for i in (1, 2):  # each copy keeps host0's manifest, signed under the cluster key, with its digests
                recorded = Manifest.from_json(json.loads((tmp_path / f"host{i}" / "llama" / MANIFEST).read_text()))
                seal.verify(recorded)
                assert recorded.signer == "host0" and len(recorded.sha256) == len(recorded.pieces)
            with capsys.disabled():
                print(
                    f"\n[multihost fetch] 2 hosts fetched {fetched} bytes of the {manifest.nbytes()}-byte model "
                    f"from host0 over mutual TLS; all 3 in the plan {ready:.1f}s after start"
                )
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
