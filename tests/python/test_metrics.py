"""The client's Prometheus endpoint through the Python module (metrics_port=...; the daemons'
and the exposition format's own tests: tests/unit/metrics_test.cc, tests/metrics/)."""
import os
import socket
import tempfile
import unittest
import urllib.error
import urllib.request

import numpy as np

import shardps
import shardps.launch


def scrape(address):
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


class ClientMetricsTest(unittest.TestCase):
    def test_a_training_client_serves_its_counters(self):
        with tempfile.TemporaryDirectory() as tmp, \
                shardps.launch.LocalCluster(servers=2, workers=1, lr=0.5, partition_bytes=128,
                                            grace=1.0) as cl:
            addr_file = os.path.join(tmp, "worker-%p.addr")
            c = shardps.Client(cl.address, cluster_token=cl.token, transport="tcp",
                               bind_ip="127.0.0.1", setup_timeout_ms=20000,
                               wait_timeout_ms=10000, metrics_port=-1,
                               metrics_address_file=addr_file)
            with c:
                with open(addr_file.replace("%p", str(os.getpid()))) as f:
                    address = f.read().strip()
                self.assertTrue(address.startswith("127.0.0.1:"), address)
                w = np.zeros(100, dtype=np.float32)  # 400 B: 4 chunks of 128 B
                g = np.ones_like(w)
                c.register("w", w, g)
                c.start()
                for _ in range(4):
                    c.step()  # each Step() ends with a copy of the counters for /metrics
                m = scrape(address)
                self.assertEqual(m["shardps_client_clock"], 4)
                self.assertEqual(m["shardps_client_rank"], 0)
                # The client's own counters, as of the end of the last Step(): 4 steps x 4
                # chunks pushed (400 B a step) and pulled, at least.
                k = c.counters()
                self.assertGreaterEqual(m["shardps_client_pushes_total"], 16)
                self.assertGreaterEqual(m["shardps_client_pulls_total"], 16)
                self.assertGreaterEqual(m["shardps_client_pushed_bytes_total"], 4 * 400)
                for name, key in [("pushes", "pushes"), ("pulls", "pulls"),
                                  ("pushed_bytes", "bytes_pushed"),
                                  ("pulled_bytes", "bytes_pulled"),
                                  ("control_messages", "control_messages_sent")]:
                    self.assertEqual(m[f"shardps_client_{name}_total"], k[key], name)
                # BSP: every step's weights include every clock before it.
                self.assertEqual(m['shardps_client_step_staleness_clocks_bucket{le="0"}'], 4)
                self.assertEqual(m["shardps_client_step_staleness_clocks_count"], 4)
                with self.assertRaises(urllib.error.HTTPError) as e:
                    urllib.request.urlopen(f"http://{address}/", timeout=5)
                self.assertEqual(e.exception.code, 404)

    def test_a_port_that_cannot_be_bound_fails_connect(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            port = taken.getsockname()[1]
            # Refused before any coordinator is contacted (none listens at port 1).
            with self.assertRaises(shardps.Error) as e:
                shardps.Client("127.0.0.1:1", cluster_token="x", transport="tcp",
                               metrics_port=port)
            self.assertIn(str(port), e.exception.message)
        with self.assertRaises(shardps.Error) as e:
            shardps.Client("127.0.0.1:1", cluster_token="x", transport="tcp", metrics_port=70000)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")


if __name__ == "__main__":
    unittest.main()
