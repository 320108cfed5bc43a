"""The fake Hub answers huggingface_hub's file system as the Hub does: listings, sizes, sha256
and ETags, ranged reads, 429s with Retry-After, changed files; nothing leaves 127.0.0.1."""

import hashlib
import types

import fsspec
import pytest

pytest.importorskip("huggingface_hub")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import huggingface_hub  # noqa: E402
from huggingface_hub import HfApi, HfFileSystem, constants  # noqa: E402
from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError  # noqa: E402
from huggingface_hub.utils import _http  # noqa: E402

from recipes.testing_hub import LocalHub, hub_process, use_hub_endpoint  # noqa: E402
from recipes.testing_hub_answers import HubRoute, byte_range  # noqa: E402

REPO = "datasets/owner/name"
PARQUET = "data/train/part-0.parquet"


def make_repo(root):
    """owner/name: a README (in git), a Parquet file of 10 row groups (in LFS), a JSONL file."""
    repo = root / "owner" / "name"
    (repo / "data" / "train").mkdir(parents=True)
    (repo / "README.md").write_text("# a tiny corpus\n")
    table = pa.table({"text": [f"document {i} " * 20 for i in range(2000)]})
    pq.write_table(table, repo / PARQUET, row_group_size=200)
    (repo / "data" / "extra.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (repo / "data" / ".hidden").write_text("not served")
    return repo


@pytest.fixture
def hub(tmp_path):
    """A fake Hub of `make_repo`, huggingface_hub pointed at it; fails a test whose client
    asked any other host."""
    make_repo(tmp_path)
    hosts = []

    def client_factory():
        client = _http.default_client_factory()
        client.event_hooks["request"].append(lambda request: hosts.append(request.url.host))
        return client

    huggingface_hub.set_client_factory(client_factory)
    try:
        with LocalHub(tmp_path) as server, use_hub_endpoint(server.endpoint):
            yield server
    finally:
        huggingface_hub.set_client_factory(_http.default_client_factory)
    assert hosts and set(hosts) <= {"127.0.0.1"}, hosts


@pytest.fixture
def sleeps(monkeypatch):
    """huggingface_hub's retry waits, recorded instead of slept."""
    waited = []
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=waited.append))
    return waited


def test_ls_lists_folders_and_files_with_sha256(hub, tmp_path):
    listing = {entry["name"]: entry for entry in HfFileSystem().ls(REPO, detail=True)}
    assert set(listing) == {f"{REPO}/README.md", f"{REPO}/data"}
    assert listing[f"{REPO}/data"]["type"] == "directory"
    readme = listing[f"{REPO}/README.md"]
    content = (tmp_path / "owner/name/README.md").read_bytes()
    assert readme["size"] == len(content) and readme["lfs"] is None  # a small text file: git
    assert readme["blob_id"] == hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
    (parquet,) = HfFileSystem().ls(f"{REPO}/data/train", detail=True)
    data = (tmp_path / "owner/name" / PARQUET).read_bytes()
    assert parquet["size"] == len(data)
    assert parquet["lfs"]["sha256"] == hashlib.sha256(data).hexdigest()


def test_find_lists_the_tree_recursively_over_pages(tmp_path):
    make_repo(tmp_path)
    with LocalHub(tmp_path, page_size=1) as hub, use_hub_endpoint(hub.endpoint):
        found = HfFileSystem().find(REPO)
        pages = [r for r in hub.log if r.route is HubRoute.TREE]
    expected = ["README.md", "data/extra.jsonl", PARQUET]
    assert found == [f"{REPO}/{path}" for path in expected]  # .hidden is not served
    assert len(pages) >= 3  # one entry per page: the Link header was followed


def test_info_and_metadata_give_size_sha256_etag_and_commit(hub, tmp_path):
    data = (tmp_path / "owner/name" / PARQUET).read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    info = HfFileSystem().info(f"{REPO}/{PARQUET}", refresh=True, expand_info=True)  # paths-info
    assert info["size"] == len(data) and info["lfs"]["sha256"] == sha256
    url = huggingface_hub.hf_hub_url("owner/name", PARQUET, repo_type="dataset")
    meta = huggingface_hub.get_hf_file_metadata(url)  # HEAD resolve: X-Linked-Etag, X-Repo-Commit
    assert meta.etag == sha256 and meta.size == len(data)
    assert meta.commit_hash == HfApi().dataset_info("owner/name").sha == hub.commit("owner/name")
    assert hub.heads[f"owner/name/{PARQUET}"] == 1 and not hub.gets
    (described,) = HfApi().get_paths_info("owner/name", [PARQUET, "nope"], repo_type="dataset")
    assert described.lfs.sha256 == sha256


def test_reads_whole_files_and_ranges(hub, tmp_path):
    data = (tmp_path / "owner/name" / PARQUET).read_bytes()
    fs = HfFileSystem()
    assert fs.open(f"{REPO}/data/extra.jsonl").read() == b'{"text": "one"}\n{"text": "two"}\n'
    with fs.open(f"{REPO}/{PARQUET}", block_size=1000) as f:
        f.seek(5000)
        assert f.read(1500) == data[5000:6500]
    assert fs.cat_file(f"{REPO}/{PARQUET}", start=-8) == data[-8:]
    ranged = [r for r in hub.log if r.route is HubRoute.RESOLVE and r.status == 206]
    assert len(ranged) >= 2


def test_fsspec_url_and_a_parquet_footer_through_ranges(hub, tmp_path):
    size = (tmp_path / "owner/name" / PARQUET).stat().st_size
    with fsspec.open(f"hf://{REPO}/{PARQUET}", block_size=4096) as f:
        meta = pq.ParquetFile(f).metadata
        first = pq.ParquetFile(f).read_row_group(0)
    assert meta.num_row_groups == 10 and meta.num_rows == 2000
    assert first.column("text")[0].as_py() == "document 0 " * 20
    served = [r for r in hub.log if r.route is HubRoute.RESOLVE]
    assert all(r.status == 206 for r in served) and hub.gets[f"owner/name/{PARQUET}"] < size / 4096


def test_a_throttled_read_is_retried_after_retry_after(hub, tmp_path, sleeps):
    key = f"owner/name/{PARQUET}"
    hub.retry_after = 3
    hub.limit_path[key] = 2
    data = (tmp_path / "owner/name" / PARQUET).read_bytes()
    assert HfFileSystem().open(f"{REPO}/{PARQUET}").read() == data
    assert sleeps == [4.0, 4.0]  # huggingface_hub waits Retry-After + 1 s, then asks again
    assert hub.throttled[key] == 2 and hub.gets[key] == 3


def test_throttled_listing_is_retried_but_throttled_api_calls_raise(hub, sleeps):
    HfFileSystem().ls(REPO)  # repo info, then the tree
    hub.limit_next = 1
    HfFileSystem().ls(f"{REPO}/data", refresh=True)  # the tree goes through http_backoff
    assert sleeps == [2.0]
    hub.limit_next = 1
    with pytest.raises(HfHubHTTPError) as raised:  # repo info and paths-info do not retry
        HfApi().get_paths_info("owner/name", [PARQUET], repo_type="dataset")
    assert raised.value.response.status_code == 429
    hub.limit_next = 1
    with pytest.raises(HfHubHTTPError) as raised:  # a new file system asks for the repo's info
        HfFileSystem(skip_instance_cache=True).ls(REPO)
    assert raised.value.response.status_code == 429
    assert sum(hub.throttled.values()) == 3 and sleeps == [2.0]


def test_a_changed_file_has_a_new_sha256_etag_and_commit(hub):
    fs = HfFileSystem()
    before = fs.info(f"{REPO}/{PARQUET}", refresh=True, expand_info=True)["lfs"]["sha256"]
    old_commit = hub.commit("owner/name")
    changed = hub.write_file("owner/name", PARQUET, b"PAR1 not the same PAR1")
    assert changed.sha256 == hashlib.sha256(b"PAR1 not the same PAR1").hexdigest() != before
    after = fs.info(f"{REPO}/{PARQUET}", refresh=True, expand_info=True)["lfs"]["sha256"]
    assert after == changed.sha256
    url = huggingface_hub.hf_hub_url("owner/name", PARQUET, repo_type="dataset")
    assert huggingface_hub.get_hf_file_metadata(url).etag == changed.sha256
    assert hub.commit("owner/name") != old_commit
    with pytest.raises(RevisionNotFoundError):  # no history: the old commit is gone
        HfApi().dataset_info("owner/name", revision=old_commit)


def test_use_hub_endpoint_restores_huggingface_hub(tmp_path):
    before = constants.ENDPOINT
    with LocalHub(tmp_path) as hub, use_hub_endpoint(hub.endpoint):
        assert constants.ENDPOINT == hub.endpoint and not constants.is_offline_mode()
    assert constants.ENDPOINT == before


def test_a_hub_in_a_process_of_its_own(tmp_path):
    make_repo(tmp_path)
    with hub_process(tmp_path) as endpoint:
        fs = HfFileSystem(endpoint=endpoint, token=False)  # without use_hub_endpoint
        assert fs.cat_file(f"{REPO}/README.md") == b"# a tiny corpus\n"


@pytest.mark.parametrize(
    "header, expected",
    [
        ("bytes=0-9", (0, 10)),
        ("bytes=5-", (5, 100)),
        ("bytes=90-200", (90, 100)),
        ("bytes=-10", (90, 100)),
        ("bytes=100-", None),
        ("bytes=-", None),
        ("bytes=0-1,5-6", None),
    ],
)
def test_byte_ranges(header, expected):
    assert byte_range(header, 100) == expected
