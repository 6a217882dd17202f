"""CUSTOM_CPU_AFFINITY: parsing, NUMA nodes from sysfs, and the placement checks."""

from __future__ import annotations

import os

import pytest
from syshax.workers.cpu.affinity import (
    AffinityError,
    format_cpu_list,
    node_of,
    numa_nodes,
    parse_cpu_list,
    resolve_affinity,
    validate_affinity,
)

TWO_NODES = {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
ALL = set(range(8))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("0-15", list(range(16))),
        ("0-30:2,32-62:2", list(range(0, 31, 2)) + list(range(32, 63, 2))),
        ("3", [3]),
        ("0,2,4-7", [0, 2, 4, 5, 6, 7]),
        (" 0 , 2 ,\t4-7 ", [0, 2, 4, 5, 6, 7]),
        ("7,3,5-6", [7, 3, 5, 6]),  # order kept: thread i goes to the i-th CPU
        ("4-4", [4]),
        ("0-7:3", [0, 3, 6]),
    ],
)
def test_parse_valid(spec, expected):
    assert parse_cpu_list(spec) == expected


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("", "empty item"),
        ("0,,2", "empty item"),
        ("0,", "empty item"),
        ("a", "'a' is not a CPU number"),
        ("0-x", "'x' is not a CPU number"),
        ("1.5", "'1.5' is not a CPU number"),
        ("-3", "negative number -3"),
        ("0--3", "negative number -3"),
        ("5-2", "end 2 is below start 5"),
        ("0-7:0", "step 0 must be at least 1"),
        ("0-7:-2", "negative number -2"),
        ("3:2", "a step needs a range"),
        ("0-3,2", "CPU 2 is listed twice"),
        ("0-6:2,4", "CPU 4 is listed twice"),
    ],
)
def test_parse_rejects(spec, problem):
    with pytest.raises(AffinityError, match="CUSTOM_CPU_AFFINITY") as err:
        parse_cpu_list(spec)
    assert problem in str(err.value)
    assert isinstance(err.value, ValueError)


def test_parse_error_names_the_item():
    with pytest.raises(AffinityError, match=r"in item '5-2'"):
        parse_cpu_list("0-3,5-2")


def test_format_cpu_list():
    assert format_cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert format_cpu_list({11, 10, 8, 3, 2, 1, 0}) == "0-3,8,10-11"
    assert format_cpu_list([5]) == "5"
    assert format_cpu_list([]) == ""


def test_numa_nodes_from_sysfs(tmp_path):
    for node, cpulist in [(0, "0-1"), (1, "2-3"), (2, "")]:  # node 2: memory only
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (tmp_path / "possible").write_text("0-2\n")  # sysfs siblings that are not nodes
    (tmp_path / "power").mkdir()
    assert numa_nodes(tmp_path) == {0: {0, 1}, 1: {2, 3}}


def test_numa_nodes_multi_range_cpulist(tmp_path):
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text("0-3,8-11\n")
    assert numa_nodes(tmp_path) == {0: {0, 1, 2, 3, 8, 9, 10, 11}}


def test_numa_nodes_missing_folder_is_one_node(tmp_path):
    assert numa_nodes(tmp_path / "absent") == {0: set(os.sched_getaffinity(0))}


def test_node_of():
    assert node_of(5, TWO_NODES) == 1
    with pytest.raises(AffinityError, match="CPU 9 does not exist"):
        node_of(9, TWO_NODES)


def test_validate_count_mismatch():
    with pytest.raises(AffinityError, match="lists 2 CPUs .* runs 4 threads") as err:
        validate_affinity([0, 1], 4, nodes=TWO_NODES, allowed=ALL)
    assert "OMP_NUM_THREADS" in str(err.value)


def test_validate_cpu_not_allowed():
    with pytest.raises(AffinityError, match=r"CPU 3 is not usable .*usable CPUs: 0-2,4-7"):
        validate_affinity([0, 3], 2, nodes=TWO_NODES, allowed=ALL - {3})


def test_validate_cpu_missing():
    with pytest.raises(AffinityError, match="CPU 8 does not exist"):
        validate_affinity([0, 8], 2, nodes=TWO_NODES, allowed=ALL)


def test_validate_unequal_spread():
    with pytest.raises(AffinityError, match="unequally") as err:
        validate_affinity([0, 1, 2, 4], 4, nodes=TWO_NODES, allowed=ALL)
    assert "node 0: 3 CPUs (0-2); node 1: 1 CPU (4)" in str(err.value)


def test_validate_equal_spread_passes():
    validate_affinity([0, 4, 1, 5], 4, nodes=TWO_NODES, allowed=ALL)


def test_validate_single_node_passes():
    validate_affinity([0, 1, 2], 3, nodes=TWO_NODES, allowed=ALL)
    validate_affinity([4], 1, nodes=TWO_NODES, allowed=ALL)


@pytest.mark.parametrize("spec", [None, "", "  "])
def test_resolve_unset(spec):
    assert resolve_affinity(spec, 4) is None


def test_resolve_on_this_machine():
    cpu = min(os.sched_getaffinity(0))
    assert resolve_affinity(str(cpu), 1) == [cpu]
    with pytest.raises(AffinityError, match="runs 2 threads"):
        resolve_affinity(str(cpu), 2)


def test_resolve_passes_nodes_and_allowed():
    assert resolve_affinity("0,4", 2, nodes=TWO_NODES, allowed=ALL) == [0, 4]
    with pytest.raises(AffinityError, match="unequally"):
        resolve_affinity("0,1,4", 3, nodes=TWO_NODES, allowed=ALL)
