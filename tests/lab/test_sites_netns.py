"""Sites behind firewalls that let only HTTPS out, one of them only through a proxy: the proof on one machine.

``SiteNetwork`` (tests/netns_sites.py) builds a hub host, three site hosts and a proxy host as network
namespaces: each site's firewall lets no connection in and lets out only TCP to the hub's HTTPS port;
site 3 may open nothing but the proxy (Debian's tinyproxy, which may open only the hub's HTTPS port).
The notebook's side (``multihost_driver.py``) runs in the hub host; each site runs the join command in
its own host, site 3 with ``HTTPS_PROXY``. TLS is real: the test makes a certificate authority, the hub
serves a certificate it signed, the sites check it against it (``--cafile``).

With the firewall on: the isolation is checked first (sites cannot reach each other nor any port of the
hub but HTTPS; the proxied site only through the proxy); then every site's ranks listen on loopback
only and the hub on nothing but its HTTPS port; 200 tasks over the three sites with site 1's link cut
and restored mid-queue, every task once; an ensemble across the sites; DiLoCo fused across the three
sites (two ranks each) with site 2 killed mid-run and joined again, every share trained once, within
5% of the same DiLoCo on the hub machine's own ranks; at the end no process is left in any host.
"""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import time

import pytest

from labkit.line.agent_link import REFUSED_SECONDS
from tests.multihost_driver import DriverClient
from tests.netns_hosts import ip, running
from tests.netns_sites import SiteNetwork, SiteProcess, site_network_unavailable

UNAVAILABLE = site_network_unavailable(shaping=False)
pytestmark = [pytest.mark.lab, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"site network: {UNAVAILABLE}")]

HTTPS_PORT = 8443


def make_authority(folder) -> tuple[str, str, str]:
    """(CA certificate, hub certificate, hub key) paths: a CA of the test's own, and a certificate it signed
    for the hub's address."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, hub_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "labkit test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    hub = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lab hub")]))
           .issuer_name(ca_name).public_key(hub_key.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
           .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("198.18.0.1"))]),
                          critical=False)
           .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
           .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
           .sign(ca_key, hashes.SHA256()))
    paths = [str(folder / name) for name in ("ca.pem", "hub.pem", "hub.key")]
    for path, data in zip(paths, (ca.public_bytes(serialization.Encoding.PEM),
                                  hub.public_bytes(serialization.Encoding.PEM),
                                  hub_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))):
        with open(path, "wb") as handle:
            handle.write(data)
    return paths[0], paths[1], paths[2]


def namespace_pids(network: SiteNetwork, host: int) -> list[int]:
    """What runs in ``host``, but the network's own helpers (its link delay where netem is missing)."""
    return [int(pid) for pid in ip("netns", "pids", network.namespace(host)).split()
            if int(pid) not in network.own_pids(host)]


def test_sites_behind_https_only_firewalls_and_a_proxy_run_tasks_ensembles_and_fused_diloco(tmp_path):
    # 40 ms each way and 50 Mbit/s where the kernel has netem; else tbf keeps the rate alone (network.links)
    with SiteNetwork(sites=3, proxied=(3,), https_port=HTTPS_PORT) as network:
        print(f"site links: {network.links}")
        isolation = network.check_isolation()
        assert isolation == network.expected_isolation()  # before the lab: nothing but HTTPS to the hub gets out
        cafile, certfile, keyfile = make_authority(tmp_path)
        driver = DriverClient(network, name="hub")
        sites: list[SiteProcess] = []
        try:
            started = driver.ask(120, command="start", ranks=3, threads_per_rank=1, timeout=300, start_timeout=90)
            assert started["ok"], started
            opened = driver.ask(30, command="exec", code=(
                f"result = lab.join_command(https=True, address={network.hub_address!r}, port={HTTPS_PORT}, "
                f"certfile={certfile!r}, keyfile={keyfile!r})"))
            assert opened["ok"] and "lkline1." in opened["result"], opened
            command = opened["result"]
            names = {1: "east", 2: "west", 3: "north"}
            sites = [SiteProcess(network, site, command, names[site], 2, cafile, tmp_path) for site in (1, 2, 3)]
            joined = driver.ask(120, command="exec", code=(
                "result = lab.wait_for_sites(names=['east', 'west', 'north'], timeout=100)"))
            assert joined["ok"] and joined["result"] == ["east", "north", "west"], (joined, [s.log.read_text()
                                                                                       for s in sites])

            # Nothing of a site listens but on its loopback; the hub host only on its HTTPS port.
            formed = driver.ask(180, command="exec", code=(
                "result = [lab.site(name).run_cell('rank') for name in ('east', 'west', 'north')]"))
            assert formed["ok"] and formed["result"] == [["0", "1"]] * 3, formed
            for site in sites:
                listening = listening_in(network, network.site_host(site.site))
                assert listening and {address for address, _ in listening} == {"127.0.0.1"}, (site.name, listening)
            hub_listening = listening_in(network, network.hub_host)
            assert {(address, port) for address, port in hub_listening if address != "127.0.0.1"} \
                == {(network.hub_address, HTTPS_PORT)}, hub_listening
            # While the lab runs, still nothing but the line: a site reaches no other site, no hub port but HTTPS.
            with network.listening({network.site_host(2): [5555], network.hub_host: [8888]}):
                assert not network.reaches(network.site_host(1), network.site_host(2), 5555)
                assert not network.reaches(network.site_host(1), network.hub_host, 8888)
                assert network.reaches(network.site_host(2), network.site_host(2), 5555)  # the listener is there

            # 200 tasks over the sites; site 1 (east) cut off for 5 s in the middle.
            queued = driver.ask(30, command="exec", code=(
                "import threading\n"
                "def square(item):\n"
                "    import time\n"
                "    time.sleep(0.3)\n"
                "    return item * item\n"
                "box = {}\n"
                "def queue():\n"
                "    box['results'] = lab.tasks(square, range(200), sites=['east', 'west', 'north'], live=False)\n"
                "worker = threading.Thread(target=queue)\n"
                "worker.start()\n"))
            assert queued["ok"], queued
            time.sleep(2.0)
            network.cut(1)
            time.sleep(5.0)
            network.restore(1)
            tasks = driver.ask(300, command="exec", code=(
                "worker.join()\n"
                "results = box['results']\n"
                "result = dict(values=results.values, per_rank={str(k): v for k, v in results.per_rank().items()},"
                " events=results.events)\n"))
            assert tasks["ok"], tasks
            assert tasks["result"]["values"] == [item * item for item in range(200)]  # every task once
            assert any("east" in event for event in tasks["result"]["events"]), tasks["result"]
            assert any(key.startswith("north") for key in tasks["result"]["per_rank"])  # through the proxy too
            back = driver.ask(180, command="exec", code="result = lab.site('east').run_cell('rank')")
            assert back["ok"] and back["result"] == ["0", "1"], back  # the cut site works again

            ensemble = driver.ask(300, command="exec", code=(
                "report = lab.ensemble('mlp', members=6, steps=5, sites='all')\n"
                "result = dict(members=len(report.members), where=sorted(str(k) for k in report.tasks.per_rank()))\n"))
            assert ensemble["ok"] and ensemble["result"]["members"] == 6, ensemble
            assert any(":" in where for where in ensemble["result"]["where"]), ensemble  # members trained on sites

            # Fused DiLoCo: the same run on the hub's own three ranks first, then across the sites, west killed.
            one = driver.ask(300, command="exec", code=(
                "settings = dict(model='gpt', lr=3e-3, global_batch=24, inner_steps=10, steps=300)\n"
                "lab.train('diloco', mesh={'replica': 3}, **settings)\n"
                "reference_state = {k: v.numpy() for k, v in lab.model_state().items()}\n"
                "run = lab.train('diloco', sites=['east', 'west', 'north'], background=True, **settings)\n"
                "import time\n"
                "while run.progress()['round'] < 2 and not run.done:\n"
                "    time.sleep(0.05)\n"
                "result = run.progress()['round']\n"))
            assert one["ok"], one
            west = sites[1]
            west.kill()
            time.sleep(1.0)
            sites[1] = SiteProcess(network, 2, command, "west", 2, cafile, tmp_path)  # the machine joins again
            fused = driver.ask(400, command="exec", code=(
                "import os, sys\n"
                "sys.path.insert(0, os.getcwd())\n"
                "from tests.lab.test_sites import heldout_loss\n"
                "report = run.wait(380)\n"
                "result = dict(rounds=[(r.round, r.used, r.left_out, {k: list(v) for k, v in r.shares.items()})"
                " for r in report.rounds], final=heldout_loss(report.model_state(), 'gpt'),"
                " reference=heldout_loss(reference_state, 'gpt'), text=str(report))\n"))
            assert fused["ok"], fused
            rounds = fused["result"]["rounds"]
            left = [entry for entry in rounds if entry[2]]
            assert left and left[0][2] == ["west"], fused["result"]["text"]
            assert any("west" in entry[1] for entry in rounds if entry[0] > left[0][0]), fused["result"]["text"]
            shares = sorted(tuple(share) for _, used, _, by_site in rounds for name, share in by_site.items()
                            if name in used)
            assert shares == [(block, part) for block in range(30) for part in range(3)]  # every share once
            final, reference = fused["result"]["final"], fused["result"]["reference"]
            print(f"held-out loss across firewalled sites {final:.4f}, one machine {reference:.4f}")
            assert abs(final - reference) <= 0.05 * reference, (final, reference)
        finally:
            try:
                driver.ask(60, command="stop")
            finally:
                for site in sites:
                    try:
                        # The lab's stop ends every site's join command; one whose line was down then
                        # finds nothing at the hub's address and leaves within REFUSED_SECONDS.
                        site.process.wait(REFUSED_SECONDS + 15)
                    except subprocess.TimeoutExpired:
                        site.kill()
                        raise
        for host in (1, 2, 3):
            assert running(namespace_pids(network, network.site_host(host))) == [], f"site {host} left processes"


def listening_in(network: SiteNetwork, host: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket in ``host``, whoever holds it (``ss`` inside the host)."""
    lines = subprocess.run(network.command(host, ["ss", "-H", "-l", "-t", "-n"]), capture_output=True, text=True,
                           timeout=10, check=True).stdout.splitlines()
    found = set()
    for line in lines:
        local = line.split()[3]  # State Recv-Q Send-Q Local:Port Peer:Port
        address, _, port = local.rpartition(":")
        found.add((address.strip("[]").removeprefix("::ffff:"), int(port)))
    return found
