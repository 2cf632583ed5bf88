"""benchmarks.serving_profile's bookkeeping (no server): process roles and CPU time per role."""

from benchmarks.serving_profile import LOAD_GENERATOR, by_role, role_of


def test_roles_come_from_the_ray_process_titles():
    assert role_of("ray::RayWorkerBody.execute_bytes") == "TP worker"
    assert role_of("ray::ServeReplica:pagedray:PagedEngine") == "engine replica"
    assert role_of("ray::ServeReplica:pagedray:OpenAIIngress") == "ingress"
    assert role_of("ray::ProxyActor") == "Serve proxy"
    assert role_of("/usr/bin/raylet --node") == "other (Ray, server CLI)"


def test_cpu_time_is_the_difference_per_role_and_new_processes_count_whole():
    before = {1: ("TP worker", 10.0), 2: ("ingress", 1.0), 3: (LOAD_GENERATOR, 5.0), 4: ("ingress", 2.0)}
    after = {1: ("TP worker", 30.5), 2: ("ingress", 1.5), 3: (LOAD_GENERATOR, 6.0), 5: ("ingress", 0.25)}
    assert by_role(before, after) == {"TP worker": 20.5, LOAD_GENERATOR: 1.0, "ingress": 0.75}
    assert list(by_role(before, after)) == ["TP worker", LOAD_GENERATOR, "ingress"]   # largest first
