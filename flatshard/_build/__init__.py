"""Construction: hybrid sharding's default groups, deferred initialisation, building one unit,
and the plan of which modules become units."""
