-- A SQLite database written by rayeval before users, owners and migrations existed (the schema
-- of branch house; made with its EvaluationStore.create_schema, create, transition,
-- record_progress and finish_succeeded). tests/test_store.py migrates it and checks every row.
BEGIN TRANSACTION;
CREATE TABLE evaluation_events (
	pk INTEGER NOT NULL, 
	evaluation_id VARCHAR(32) NOT NULL, 
	seq INTEGER NOT NULL, 
	type VARCHAR(32) NOT NULL, 
	data JSON NOT NULL, 
	created_at DATETIME NOT NULL, 
	PRIMARY KEY (pk), 
	UNIQUE (evaluation_id, seq), 
	FOREIGN KEY(evaluation_id) REFERENCES evaluations (id)
);
INSERT INTO "evaluation_events" VALUES(1,'800c06f8663d4e05',1,'state','{"status": "queued", "error": null}','2026-12-04 22:04:12.494652');
INSERT INTO "evaluation_events" VALUES(2,'800c06f8663d4e05',2,'state','{"status": "starting", "error": null}','2026-12-04 22:04:12.498110');
INSERT INTO "evaluation_events" VALUES(3,'800c06f8663d4e05',3,'state','{"status": "running", "error": null}','2026-12-04 22:04:12.499567');
INSERT INTO "evaluation_events" VALUES(4,'800c06f8663d4e05',4,'progress','{"done": 4, "total": 4}','2026-12-04 22:04:12.501125');
INSERT INTO "evaluation_events" VALUES(5,'800c06f8663d4e05',5,'result','{}','2026-12-04 22:04:12.503586');
INSERT INTO "evaluation_events" VALUES(6,'800c06f8663d4e05',6,'state','{"status": "succeeded", "error": null}','2026-12-04 22:04:12.503586');
INSERT INTO "evaluation_events" VALUES(7,'8fafe3fc384d44c5',1,'state','{"status": "queued", "error": null}','2026-12-04 22:04:12.505194');
CREATE TABLE evaluation_results (
	evaluation_id VARCHAR(32) NOT NULL, 
	results_json TEXT NOT NULL, 
	stats JSON NOT NULL, 
	PRIMARY KEY (evaluation_id), 
	FOREIGN KEY(evaluation_id) REFERENCES evaluations (id)
);
INSERT INTO "evaluation_results" VALUES('800c06f8663d4e05','{"results": {"demo_mc": {"acc,none": 0.5}}}','{"loglikelihood": {"requests": 4}}');
CREATE TABLE evaluation_samples (
	evaluation_id VARCHAR(32) NOT NULL, 
	task VARCHAR(255) NOT NULL, 
	jsonl TEXT NOT NULL, 
	PRIMARY KEY (evaluation_id, task), 
	FOREIGN KEY(evaluation_id) REFERENCES evaluations (id)
);
INSERT INTO "evaluation_samples" VALUES('800c06f8663d4e05','demo_mc','{"doc_id": 0}
');
CREATE TABLE evaluations (
	number INTEGER NOT NULL, 
	id VARCHAR(32) NOT NULL, 
	status VARCHAR(16) NOT NULL, 
	spec JSON NOT NULL, 
	resources JSON NOT NULL, 
	created_at DATETIME NOT NULL, 
	started_at DATETIME, 
	finished_at DATETIME, 
	error TEXT, 
	progress JSON NOT NULL, 
	last_event_seq INTEGER NOT NULL, 
	runner_cursor INTEGER NOT NULL, 
	PRIMARY KEY (number)
);
INSERT INTO "evaluations" VALUES(1,'800c06f8663d4e05','succeeded','{"model": "hf", "model_args": {"pretrained": "/models/tiny", "dtype": "float32"}, "tasks": ["demo_mc"], "parallelism": {"num_replicas": 1, "shard_size": 1}}','{"CPU": 1.0}','2026-12-04 22:04:12.490227','2026-12-04 22:04:12.496858','2026-12-04 22:04:12.501714',NULL,'{"phases": {}}',6,3);
INSERT INTO "evaluations" VALUES(2,'8fafe3fc384d44c5','queued','{"model": "hf", "model_args": {"pretrained": "/models/tiny", "dtype": "float32"}, "tasks": ["demo_cloze"], "parallelism": {"num_replicas": 1, "shard_size": 1}}','{"CPU": 2.0}','2026-12-04 22:04:12.504580',NULL,NULL,NULL,'{"phases": {}}',1,0);
CREATE INDEX ix_evaluations_status ON evaluations (status);
CREATE UNIQUE INDEX ix_evaluations_id ON evaluations (id);
CREATE INDEX ix_evaluation_events_evaluation_id ON evaluation_events (evaluation_id);
COMMIT;
