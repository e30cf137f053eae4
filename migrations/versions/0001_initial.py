"""Initial schema: tenants, API keys, files, idempotency keys, jobs, job events, checkpoints and
memory samples — designed for the later issues (scheduler leases, ingest dedupe, memory telemetry).

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None

# Spelled out here (not imported from service.store.models) so this revision never changes with the app.
TS = sa.DateTime(timezone=True)
JSON_ = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
# SQLite auto-increments only an INTEGER PRIMARY KEY.
BIGID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table('tenants',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('created_at', TS, nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenants')),
    sa.UniqueConstraint('name', name=op.f('uq_tenants_name'))
    )
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=32), nullable=False),
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', TS, nullable=False),
    sa.Column('revoked_at', TS, nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_api_keys_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('prefix', name=op.f('uq_api_keys_prefix'))
    )
    op.create_index(op.f('ix_api_keys_tenant_id'), 'api_keys', ['tenant_id'], unique=False)
    op.create_table('files',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('filename', sa.String(length=512), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('format', sa.String(length=32), nullable=True),
    sa.Column('rows', sa.Integer(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('created_at', TS, nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_files_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_files'))
    )
    op.create_index(op.f('ix_files_tenant_id_created_at_id'), 'files', ['tenant_id', 'created_at', 'id'], unique=False)
    op.create_table('idempotency_keys',
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('response_body', JSON_, nullable=True),
    sa.Column('created_at', TS, nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_idempotency_keys_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('tenant_id', 'key', name=op.f('pk_idempotency_keys'))
    )
    op.create_index(op.f('ix_idempotency_keys_created_at'), 'idempotency_keys', ['created_at'], unique=False)
    op.create_table('jobs',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('spec', JSON_, nullable=False),
    sa.Column('model', sa.String(length=512), nullable=False),
    sa.Column('training_file', sa.String(length=128), nullable=False),
    sa.Column('validation_file', sa.String(length=128), nullable=True),
    sa.Column('suffix', sa.String(length=64), nullable=True),
    sa.Column('seed', sa.BigInteger(), nullable=True),
    sa.Column('metadata', JSON_, nullable=True),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('lease_owner', sa.String(length=200), nullable=True),
    sa.Column('lease_expires_at', TS, nullable=True),
    sa.Column('ray_submission_id', sa.String(length=200), nullable=True),
    sa.Column('ray_status', sa.String(length=32), nullable=True),
    sa.Column('desired_state', sa.String(length=16), nullable=True),
    sa.Column('created_at', TS, nullable=False),
    sa.Column('updated_at', TS, nullable=False),
    sa.Column('started_at', TS, nullable=True),
    sa.Column('finished_at', TS, nullable=True),
    sa.Column('estimated_finish', TS, nullable=True),
    sa.Column('fine_tuned_model', sa.String(length=512), nullable=True),
    sa.Column('result_files', JSON_, nullable=False),
    sa.Column('trained_tokens', sa.BigInteger(), nullable=True),
    sa.Column('error', JSON_, nullable=True),
    sa.Column('plan', JSON_, nullable=True),
    sa.Column('memory_summary', JSON_, nullable=True),
    sa.Column('ingest_token_hash', sa.String(length=64), nullable=True),
    sa.Column('output_dir', sa.Text(), nullable=True),
    sa.CheckConstraint("status IN ('validating_files', 'queued', 'running', 'paused', 'succeeded', 'failed', 'cancelled')",
                       name=op.f('ck_jobs_status')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_jobs_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    op.create_index(op.f('ix_jobs_status_created_at'), 'jobs', ['status', 'created_at'], unique=False)
    op.create_index(op.f('ix_jobs_tenant_id_created_at_id'), 'jobs', ['tenant_id', 'created_at', 'id'], unique=False)
    op.create_table('checkpoints',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('metrics', JSON_, nullable=True),
    sa.Column('created_at', TS, nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_checkpoints_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('job_id', 'step', name=op.f('uq_checkpoints_job_id_step'))
    )
    op.create_table('job_events',
    sa.Column('id', BIGID, autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', TS, nullable=False),
    sa.Column('level', sa.String(length=8), nullable=False),
    sa.Column('type', sa.String(length=16), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('data', JSON_, nullable=True),
    sa.Column('attempt', sa.Integer(), nullable=True),
    sa.Column('dedupe_key', sa.String(length=200), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_events_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_events')),
    sa.UniqueConstraint('job_id', 'dedupe_key', name=op.f('uq_job_events_job_id_dedupe_key'))
    )
    op.create_index(op.f('ix_job_events_job_id_id'), 'job_events', ['job_id', 'id'], unique=False)
    op.create_table('memory_samples',
    sa.Column('id', BIGID, autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('phase', sa.String(length=16), nullable=False),
    sa.Column('source', sa.String(length=32), nullable=False),
    sa.Column('parameters_bytes', sa.BigInteger(), nullable=True),
    sa.Column('gradients_bytes', sa.BigInteger(), nullable=True),
    sa.Column('optimizer_bytes', sa.BigInteger(), nullable=True),
    sa.Column('activations_bytes', sa.BigInteger(), nullable=True),
    sa.Column('temporary_bytes', sa.BigInteger(), nullable=True),
    sa.Column('other_bytes', sa.BigInteger(), nullable=True),
    sa.Column('peak_bytes', sa.BigInteger(), nullable=True),
    sa.Column('host_parameters_bytes', sa.BigInteger(), nullable=True),
    sa.Column('host_gradients_bytes', sa.BigInteger(), nullable=True),
    sa.Column('host_optimizer_bytes', sa.BigInteger(), nullable=True),
    sa.Column('process_rss_bytes', sa.BigInteger(), nullable=True),
    sa.Column('device', JSON_, nullable=True),
    sa.Column('created_at', TS, nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_memory_samples_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_memory_samples')),
    sa.UniqueConstraint('job_id', 'attempt', 'rank', 'step', 'phase', name=op.f('uq_memory_samples_job_id_attempt_rank_step_phase'))
    )


def downgrade() -> None:
    op.drop_table('memory_samples')
    op.drop_index(op.f('ix_job_events_job_id_id'), table_name='job_events')
    op.drop_table('job_events')
    op.drop_table('checkpoints')
    op.drop_index(op.f('ix_jobs_tenant_id_created_at_id'), table_name='jobs')
    op.drop_index(op.f('ix_jobs_status_created_at'), table_name='jobs')
    op.drop_table('jobs')
    op.drop_index(op.f('ix_idempotency_keys_created_at'), table_name='idempotency_keys')
    op.drop_table('idempotency_keys')
    op.drop_index(op.f('ix_files_tenant_id_created_at_id'), table_name='files')
    op.drop_table('files')
    op.drop_index(op.f('ix_api_keys_tenant_id'), table_name='api_keys')
    op.drop_table('api_keys')
    op.drop_table('tenants')
