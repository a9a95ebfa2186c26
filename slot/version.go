package slot

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// MinServerVersion is the oldest PostgreSQL walrelay supports, as
// server_version_num: 14, the oldest release the version matrix (`make
// test-pg`) tests. Older servers are refused at setup.
const MinServerVersion = 140000

// checkServerVersion refuses a server older than MinServerVersion.
func checkServerVersion(ctx context.Context, conn *pgx.Conn) error {
	var num int
	var version string
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int, current_setting('server_version')").Scan(&num, &version); err != nil {
		return fmt.Errorf("read the server's version: %w", err)
	}
	return versionError(num, version)
}

// versionError is the refusal of server version num (server_version
// version), or nil.
func versionError(num int, version string) error {
	if num >= MinServerVersion {
		return nil
	}
	return setupErrorf("PostgreSQL %s is older than %d, the oldest version walrelay supports: upgrade the server to PostgreSQL %d or later", version, MinServerVersion/10000, MinServerVersion/10000)
}
