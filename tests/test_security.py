"""Issue 23: nobody else on the machine can drive the ranks. The embedded cluster's scheduler,
workers, controller and rank channels speak mutual TLS with certificates made at start;
``security=False`` turns it off; a TLS cluster started with the ``dask`` commands is joined with
``tls://`` and a Security; a plaintext client is refused by a TLS scheduler."""

import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest
import torch
from distributed import Client
from distributed.security import Security

import dtorch
from dtorch import Replicate, Shard, init_device_mesh
from dask_commands import dask_commands
from dtorch.runtime.channel import CONTROLLER, TOKEN_BYTES, accept_peer, connect



def _refused(fn) -> bool:
    """Whether ``fn`` (a connection attempt) is turned away: a TLS error, a reset or the other
    end closing; a timeout is no refusal (a server that accepted and waits would pass)."""
    try:
        fn()
    except (ssl.SSLError, ConnectionError):
        return True
    except OSError as exc:
        return "timed out" not in str(exc)
    return False


STRANGER = r"""
import json, socket, ssl, sys
from distributed import Client
scheduler, workers = sys.argv[1], sys.argv[2:]


def refused(fn):  # a Dask client that raised anything did not get in
    try:
        fn()
    except BaseException:
        return True
    return False


def dask_client(address):
    Client(address, timeout=5).close()


def handshake_refused(address):
    # a TLS client without a certificate: turned away (a TLS error, a reset, the end of the
    # stream), not left waiting (a timeout counts as not refused)
    anonymous = ssl.create_default_context()
    anonymous.check_hostname, anonymous.verify_mode = False, ssl.CERT_NONE
    host, port = address.split("://")[-1].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            with anonymous.wrap_socket(raw) as tls:
                tls.sendall(b"x")
                return tls.recv(1) == b""  # TLS 1.3: the refusal comes with the first read
    except (ssl.SSLError, ConnectionError):
        return True
    except OSError:
        return False


out = {"client": refused(lambda: dask_client(scheduler)),
       "plain client": refused(lambda: dask_client(scheduler.replace("tls://", "tcp://"))),
       "handshakes": [handshake_refused(a) for a in [scheduler] + workers]}
print(json.dumps(out))
"""


def test_the_embedded_cluster_speaks_only_mutual_tls(live):
    scheduler = live.client.scheduler.address
    workers = list(live.client.scheduler_info(n_workers=-1)["workers"])
    assert scheduler.startswith("tls://") and all(w.startswith("tls://") for w in workers)
    # the controller's own connections: Dask's and the ranks' channels
    assert all(isinstance(s, ssl.SSLSocket) for s in live.channels._socks)
    assert all(isinstance(s, ssl.SSLSocket) for s in live.channels._answer_socks)
    # a process on this host without the certificates: no Dask client, plain or TLS, and no
    # TLS handshake with the scheduler or a worker (they ask for a certificate it lacks)
    out = subprocess.run([sys.executable, "-c", STRANGER, scheduler, *workers],
                         capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "client": True, "plain client": True, "handshakes": [True] * (1 + len(workers))}, \
        out.stdout + out.stderr[-2000:]
    # the cluster is untouched and works
    x = dtorch.tensor(torch.arange(8.), device_mesh=init_device_mesh("cpu", 4),
                      placements=[Shard(0)])
    assert torch.equal(x.redistribute(placements=[Replicate()]).to_torch(), torch.arange(8.))


def test_a_rank_channel_over_tls_accepts_only_the_clusters_certificate():
    """accept_peer with the cluster's TLS context: a stranger with the token but no
    certificate (or another CA's) is closed; the holder of both is served."""
    ours, theirs = Security.temporary(), Security.temporary()
    server_ctx = ours.get_listen_args("worker")["ssl_context"]
    server = socket.create_server(("127.0.0.1", 0))
    token = os.urandom(TOKEN_BYTES)
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(
        accept_peer(server, token, server_ctx)))
    thread.start()
    address = server.getsockname()
    anonymous = ssl.create_default_context()  # TLS, the token, but no certificate
    anonymous.check_hostname, anonymous.verify_mode = False, ssl.CERT_NONE
    for ctx in (None, theirs.get_connection_args("client")["ssl_context"], anonymous):
        def stranger(ctx=ctx):
            sock = connect(address, token, CONTROLLER, 10, ctx)
            sock.settimeout(10)
            if sock.recv(1) == b"":
                raise ConnectionResetError("closed")
        assert _refused(stranger)
        assert accepted == []  # not served: the listener still waits for its owner
    owner = connect(address, token, CONTROLLER, 5, ours.get_connection_args("client")
                    ["ssl_context"])
    thread.join(timeout=20)
    assert accepted and accepted[0] is not None and accepted[0][1] == CONTROLLER
    for s in (owner, accepted[0][0], server):
        s.close()


def test_security_false_is_plain_tcp(other_cluster):
    c = other_cluster(n_workers=2, security=False)
    assert c.client.scheduler.address.startswith("tcp://")
    assert not any(isinstance(s, ssl.SSLSocket) for s in c.channels._socks)
    x = dtorch.tensor(torch.arange(4.), device_mesh=init_device_mesh("cpu", 2),
                      placements=[Shard(0)])
    assert torch.equal(x.redistribute(placements=[Replicate()]).to_torch(), torch.arange(4.))


def test_a_bad_security_argument_is_refused_before_anything_starts(live):
    with pytest.raises(dtorch.ClusterError, match="security must be True, False or a "):
        dtorch.init(n_workers=3, security="yes")
    assert dtorch.cluster_info()["ranks"] == 4  # the running cluster was not touched


SEED = r"""
import json, sys, torch, dtorch
from distributed.security import Security
from dtorch import Shard, Replicate, Partial, init_device_mesh
folder = sys.argv[2]
security = Security(tls_ca_file=f"{folder}/ca.pem", tls_client_cert=f"{folder}/cert.pem",
                    tls_client_key=f"{folder}/key.pem", require_encryption=True)
dtorch.init(address=sys.argv[1], security=security)
mesh = init_device_mesh("cpu", 2)
full = torch.arange(16.).reshape(4, 4)
x = dtorch.tensor(full, device_mesh=mesh, placements=[Shard(0)])
counts = {}
for name, dst in (("S->R", [Replicate()]), ("S->S", [Shard(1)])):
    with dtorch.CommDebugMode() as mode:
        y = x.redistribute(placements=dst)
    counts[name] = mode.get_comm_counts()
    assert torch.equal(y.to_torch(), full)
p = dtorch.from_local([full, full], mesh, [Partial()])
assert torch.equal(p.full_tensor(), 2 * full)
tls = all(w.startswith("tls://") for w in dtorch.cluster_info()["workers"].values())
print(json.dumps({"counts": counts, "tls": tls}))
dtorch.shutdown()
"""

CONFIGURED = r"""
import sys, torch, dtorch
from dtorch import Shard, Replicate, init_device_mesh
dtorch.init(scheduler_file=sys.argv[1])  # the certificates come from Dask's configuration
x = dtorch.tensor(torch.arange(4.), device_mesh=init_device_mesh("cpu", 2),
                  placements=[Shard(0)])
print("SUM", x.redistribute(placements=[Replicate()]).to_torch().sum().item(),
      dtorch.cluster_info()["scheduler"].split(":")[0])
dtorch.shutdown()
"""

PLAIN = r"""
import sys, dtorch
try:
    dtorch.init(address=sys.argv[1].replace("tls://", "tcp://"))
except dtorch.ClusterError as exc:
    print("REFUSED", exc)
"""


@pytest.fixture
def tls_cluster(tmp_path):
    """`dask scheduler` and `dask worker` started with the --tls-* flags, as the README says."""
    sec = Security.temporary()
    for name, text in (("ca.pem", sec.tls_ca_file), ("cert.pem", sec.tls_scheduler_cert),
                       ("key.pem", sec.tls_scheduler_key)):
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o600)
    tls = ["--tls-ca-file", str(tmp_path / "ca.pem"), "--tls-cert", str(tmp_path / "cert.pem"),
           "--tls-key", str(tmp_path / "key.pem")]
    with dask_commands(tmp_path / "first", scheduler_args=["--protocol", "tls", *tls],
                       worker_args=tls) as address:
        yield address, tmp_path


@pytest.mark.timeout(300)
def test_a_tls_cluster_started_with_the_dask_commands(tls_cluster):
    address, folder = tls_cluster
    assert address.startswith("tls://")
    security = Security(tls_ca_file=f"{folder}/ca.pem", tls_client_cert=f"{folder}/cert.pem",
                        tls_client_key=f"{folder}/key.pem", require_encryption=True)
    deadline = time.monotonic() + 90
    with Client(address, security=security, timeout=30) as client:
        while len(client.scheduler_info()["workers"]) < 2:
            assert time.monotonic() < deadline, "dask workers did not join"
            time.sleep(0.2)
    out = subprocess.run([sys.executable, "-c", SEED, address, str(folder)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"counts": {"S->R": {"all_gather": 1}, "S->S": {"all_to_all": 1}},
                      "tls": True}
    plain = subprocess.run([sys.executable, "-c", PLAIN, address], capture_output=True,
                           text=True, timeout=120)
    assert "REFUSED cannot reach a Dask scheduler" in plain.stdout, plain.stdout + plain.stderr
    bare = subprocess.run([sys.executable, "-c", PLAIN.replace('.replace("tls://", "tcp://")',
                                                               ''), address],
                          capture_output=True, text=True, timeout=120)
    assert "speaks TLS: pass its certificates" in bare.stdout, bare.stdout + bare.stderr
    # the scheduler file `dask scheduler --scheduler-file` wrote, and the certificates in
    # Dask's configuration (its environment variables), as the dask commands' own clients do
    env = dict(os.environ, DASK_DISTRIBUTED__COMM__TLS__CA_FILE=f"{folder}/ca.pem",
               DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT=f"{folder}/cert.pem",
               DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY=f"{folder}/key.pem")
    configured = subprocess.run([sys.executable, "-c", CONFIGURED,
                                 str(folder / "first" / "scheduler.json")],
                                capture_output=True, text=True, timeout=180, env=env)
    assert "SUM 6.0 tls" in configured.stdout, configured.stdout + configured.stderr[-3000:]


def test_a_scheduler_file_that_cannot_be_read_says_what_it_should_be(live, tmp_path):
    with pytest.raises(dtorch.ClusterError, match="it is the file `dask scheduler"):
        dtorch.init(scheduler_file=str(tmp_path / "missing.json"))
    with pytest.raises(dtorch.ClusterError, match="address= or scheduler_file=, not both"):
        dtorch.init(address="tls://127.0.0.1:1", scheduler_file=str(tmp_path / "s.json"))
    assert dtorch.cluster_info()["ranks"] == 4  # the running cluster was not touched
