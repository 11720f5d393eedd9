"""`ovt-trainer` on a user's bad path or a misbehaving trainer: one line on stderr and the exit
code of bad input or a bad peer (2), never a traceback, never 1 ("the job failed")."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from proto import ovt_pb2_grpc
from protocol.commit.keys import KeyPair
from trainer_node.cli import main


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_bytes(b"")
    return path


def _one_line_error(capsys, message: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("ovt-trainer: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("under", [False, True], ids=["a-file", "under-a-file"])
def test_serve_with_a_store_that_cannot_be_a_folder_exits_2_in_one_line(tmp_path, a_file,
                                                                        capsys, under):
    """Review 26, finding 6: `--store` under a regular file ended in a NotADirectoryError
    traceback and exit 1."""
    key = tmp_path / "trainer.key"
    KeyPair.generate().save(key)
    store = a_file / "store" if under else a_file
    assert main(["serve", "--listen", "127.0.0.1:0", "--store", str(store), "--key", str(key),
                 "--profile", "cpu-1t"]) == 2
    _one_line_error(capsys, f"cannot make the store folder {store}: ")


@pytest.mark.parametrize("under", [False, True], ids=["a-file", "under-a-file"])
def test_certs_into_a_folder_that_cannot_be_made_exits_2_in_one_line(a_file, capsys, under):
    out = a_file / "tls" if under else a_file
    assert main(["certs", "--out", str(out)]) == 2
    _one_line_error(capsys, f"cannot write cert.pem and key.pem into {out}: ")


class _EmptyWatch(ovt_pb2_grpc.TrainerServicer):
    def Watch(self, request, context):
        return iter(())  # ends OK before any status


@pytest.mark.network
def test_status_watch_of_a_trainer_that_ends_watch_without_a_status_is_a_peer_error(capsys):
    """Review 26, finding 7: a Watch stream that ended OK before its first message crashed
    `status --watch` with UnboundLocalError (a traceback and exit 1, "the job failed")."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    ovt_pb2_grpc.add_TrainerServicer_to_server(_EmptyWatch(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert main(["status", "--trainer", f"127.0.0.1:{port}", "--job", "ab" * 32,
                     "--watch"]) == 2
    finally:
        server.stop(0).wait(10)
    _one_line_error(capsys, f"trainer ended Watch of job {'ab' * 32} without sending its status")
